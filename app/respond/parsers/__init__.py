"""Per-choice output parsing: reasoning first, then tool calls, in one incremental pass."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import orjson

from app.respond.parsers import reasoning as reasoning_parsers
from app.respond.parsers import tool_calls as tool_parsers
from app.respond.parsers.reasoning import ReasoningParser
from app.respond.parsers.tool_calls import HermesToolParser, ParsedCall, parse_call

REASONING_PARSERS = tuple(sorted(reasoning_parsers.PARSERS))
TOOL_CALL_PARSERS = tuple(sorted(tool_parsers.PARSERS))


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A tool call's start (``id``/``name`` set) or more of its ``arguments`` text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(slots=True)
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """How one request's output is parsed; None fields switch that parser off."""

    reasoning_starts_inside: bool | None = None
    tool_calls: bool = False
    # tool_choice naming one function: the whole output is that call's arguments.
    forced_name: str | None = None
    # tool_choice "required": the output is a JSON array of {name, parameters}.
    forced_any: bool = False

    @property
    def active(self) -> bool:
        return (
            self.reasoning_starts_inside is not None
            or self.tool_calls
            or self.forced_name is not None
            or self.forced_any
        )


class ChoiceParser:
    __slots__ = ("_calls", "_forced_buf", "_plan", "_reasoning", "_tools")

    def __init__(self, plan: OutputPlan) -> None:
        self._plan = plan
        self._reasoning = (
            ReasoningParser(plan.reasoning_starts_inside)
            if plan.reasoning_starts_inside is not None
            else None
        )
        self._tools = HermesToolParser() if plan.tool_calls else None
        self._calls = 0
        self._forced_buf: list[str] = []

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self._calls and engine_reason == "stop" and self._plan.forced_name is None:
            return "tool_calls"
        return engine_reason

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self._reasoning is not None:
            out.reasoning, text = self._reasoning.feed(text)
        self._content(text, out, final=False)
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        text = ""
        if self._reasoning is not None:
            out.reasoning, text = self._reasoning.finish()
        self._content(text, out, final=True)
        return out

    def _content(self, text: str, out: Parsed, *, final: bool) -> None:
        plan = self._plan
        if plan.forced_name is not None:
            if self._calls == 0 and (text or final):
                out.calls.append(CallDelta(0, new_call_id(), plan.forced_name, ""))
                self._calls = 1
            if text:
                out.calls.append(CallDelta(0, None, None, text))
            return
        if plan.forced_any:
            self._forced_buf.append(text)
            if final:
                self._required("".join(self._forced_buf), out)
            return
        if self._tools is None:
            out.content = text
            return
        content, calls = self._tools.feed(text) if not final else self._feed_final(text)
        out.content = content
        self._add(calls, out)

    def _feed_final(self, text: str) -> tuple[str, list[ParsedCall]]:
        assert self._tools is not None
        content, calls = self._tools.feed(text)
        more_content, more_calls = self._tools.finish()
        return content + more_content, calls + more_calls

    def _add(self, calls: list[ParsedCall], out: Parsed) -> None:
        for call in calls:
            out.calls.append(CallDelta(self._calls, new_call_id(), call.name, call.arguments))
            self._calls += 1

    def _required(self, text: str, out: Parsed) -> None:
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            value = None
        calls: list[ParsedCall] = []
        if isinstance(value, list):
            for item in value:
                call = parse_call(orjson.dumps(item).decode()) if isinstance(item, dict) else None
                if call is None:
                    calls = []
                    break
                calls.append(call)
        if not calls:
            out.content = text
            return
        self._add(calls, out)


def required_tools_schema(tools: list[tuple[str, dict[str, object] | None]]) -> dict[str, object]:
    """The JSON schema vLLM-style ``tool_choice: required`` constrains the output to."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": params or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                }
                for name, params in tools
            ],
        },
    }
