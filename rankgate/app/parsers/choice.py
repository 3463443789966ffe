"""One choice's output parsing: reasoning first, then tool calls, in one incremental pass.

The same object serves streamed and whole responses. Streaming releases only what no later
text can change: reasoning as the reasoning splitter settles it, content before a format's tool
region (whitespace held where the final answer may strip it), and each tool call once the whole
output is known (``finish``), parsed by the format's own ``extract``. A streamed answer therefore
always adds up to the non-streamed one, which is vLLM's non-streamed answer.
"""

from __future__ import annotations

import logging
import os
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rankgate.app.parsers.text import dumps, first_of, loads, partial_suffix
from rankgate.app.parsers.types import (
    ReasoningSplitter,
    ToolCall,
    ToolContext,
    ToolSyntax,
)

if TYPE_CHECKING:
    from rankgate.app.parsers.harmony import HarmonyPiece

log = logging.getLogger(__name__)

IdStyle = Callable[[int, str], str]


def vllm_call_id(index: int, name: str) -> str:
    """vLLM's default tool-call id."""
    return "chatcmpl-tool-" + os.urandom(8).hex()


_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id(index: int, name: str) -> str:
    """Mistral's tool-call ids: nine letters and digits."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def xlam_call_id(index: int, name: str) -> str:
    return f"call_{index}_{os.urandom(8).hex()}"


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
    """How one request's output is parsed; the default parses nothing."""

    # A fresh reasoning splitter per choice; None: no reasoning parser.
    reasoning: Callable[[], ReasoningSplitter] | None = None
    # The tool-call syntax when calls are parsed from the model's own format.
    tools: ToolSyntax | None = None
    context: ToolContext = field(default_factory=ToolContext)
    # tool_choice naming one function, enforced as a JSON schema: the output is its arguments.
    forced_name: str | None = None
    # tool_choice "required", enforced as a JSON schema: a JSON array of {name, parameters}.
    forced_any: bool = False
    # tool_choice named a function (however enforced): finish_reason stays the engine's.
    named: bool = False
    required: bool = False
    # parallel_tool_calls false: only the first call is returned.
    single_call: bool = False
    call_id: IdStyle = vllm_call_id
    # tool_choice "none" on a format that vLLM still parses: calls are read and dropped.
    discard_calls: bool = False
    # gpt-oss harmony channels: (reasoning parser on, tool parser on); replaces the above.
    harmony: tuple[bool, bool] | None = None
    # Whether harmony calls are returned (not for tool_choice "none").
    report_calls: bool = True
    # The parsers read special tokens, so the engine must not skip them when detokenizing.
    needs_special_tokens: bool = False

    @property
    def active(self) -> bool:
        return (
            self.reasoning is not None
            or self.tools is not None
            or self.forced_name is not None
            or self.forced_any
            or self.harmony is not None
        )


class _ToolStream:
    """Content before the tool region streams; the region is parsed once the output ends."""

    __slots__ = (
        "_blank",
        "_ctx",
        "_emitted",
        "_hold",
        "_markers",
        "_open",
        "_pending",
        "_syntax",
        "_tail",
        "_text",
        "_watch",
    )

    def __init__(self, syntax: ToolSyntax, ctx: ToolContext) -> None:
        self._syntax = syntax
        self._ctx = ctx
        self._text: list[str] = []
        self._markers = syntax.markers
        self._watch = syntax.markers + syntax.rewrites
        self._open = True
        # An engine format whose cleaned content could be replaced by the raw text (legacy
        # reasoning before it) cannot release anything early.
        self._hold: bool | None = True if syntax.engine and not ctx.engine_content else None
        self._tail = ""
        # Whitespace held back, in pieces: a long run is joined once, not copied per delta.
        self._pending: list[str] = []
        self._emitted: list[str] = []
        # Whether all content released so far was whitespace.
        self._blank = True

    def feed(self, text: str) -> str:
        if not text:
            return ""
        self._text.append(text)
        if not self._open:
            return ""
        if self._hold is None:
            self._hold = self._syntax.holds_all("".join(self._text))
            if self._hold is None:
                self._tail += text
                return ""
            if self._hold:
                self._open = False
                return ""
        raw = self._tail + text
        at, _ = first_of(raw, self._markers)
        if at >= 0:
            release, self._tail, self._open = raw[:at], "", False
        else:
            keep = partial_suffix(raw, self._watch)
            release, self._tail = raw[: len(raw) - keep], raw[len(raw) - keep :]
        return self._release(self._syntax.clean(release))

    def _release(self, text: str) -> str:
        rule = self._syntax.content_rule
        if not text or rule == "none":
            return ""
        # What is held is whitespace only, so the text decides whether all of it is.
        if not text.strip() and (self._blank or rule == "strip"):
            self._pending.append(text)
            return ""
        pending = "".join(self._pending) + text
        self._pending = []
        if rule == "keep":
            self._blank = False
            self._emitted.append(pending)
            return pending
        if self._blank:
            if pending[0].isspace():
                # Kept if no call follows, stripped if one does: undecided until the end.
                self._open = False
                return ""
            self._blank = False
        body = pending.rstrip()
        self._pending = [pending[len(body) :]]
        self._emitted.append(body)
        return body

    def finish(self) -> tuple[str, list[ToolCall]]:
        text = "".join(self._text)
        result = self._syntax.extract(text, self._ctx)
        if result.tools_called:
            final = result.content or ""
            if not final.strip():
                final = ""
        elif self._syntax.engine and self._ctx.engine_content:
            final = result.content or ""
        else:
            final = text
        sent = "".join(self._emitted)
        if not final.startswith(sent):
            log.error("tool parser released content %r that its result %r lacks", sent, final)
            return "", result.calls
        return final[len(sent) :], result.calls


class _ForcedName:
    """tool_choice naming a function under a JSON schema: the output is the arguments."""

    __slots__ = ("_held", "_started")

    def __init__(self) -> None:
        self._started = False
        # The blank start, in pieces.
        self._held: list[str] = []

    def feed(self, text: str) -> str | None:
        """The arguments text to send, or None while the output is still blank."""
        if self._started:
            return text
        self._held.append(text)
        if not text.strip():
            return None
        self._started = True
        held = "".join(self._held)
        self._held = []
        return held


def required_calls(text: str) -> list[ToolCall]:
    """vLLM's reading of a ``tool_choice: required`` output: a JSON list of function
    definitions, or no calls at all."""
    try:
        value = loads(text)
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    calls: list[ToolCall] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        params = item.get("parameters")
        if params is not None and not isinstance(params, dict):
            return []
        if item.get("description") is not None and not isinstance(item["description"], str):
            return []
        for flag in ("strict", "defer_loading"):
            if item.get(flag) not in (None, True, False):
                return []
        calls.append(ToolCall(item["name"], dumps(params)))
    return calls


class ChoiceParser:
    __slots__ = (
        "_forced",
        "_forced_buf",
        "_harmony",
        "_plan",
        "_reasoning",
        "_sent",
        "_tools",
    )

    def __init__(self, plan: OutputPlan) -> None:
        self._plan = plan
        self._harmony = None
        if plan.harmony is not None:
            from rankgate.app.parsers.harmony import HarmonyStream

            self._harmony = HarmonyStream(reasoning=plan.harmony[0], tools=plan.harmony[1])
        self._reasoning = plan.reasoning() if plan.reasoning is not None else None
        self._tools = (
            _ToolStream(plan.tools, plan.context)
            if plan.tools is not None and plan.forced_name is None and not plan.forced_any
            else None
        )
        self._forced = _ForcedName() if plan.forced_name is not None else None
        self._forced_buf: list[str] = []
        self._sent = 0

    @property
    def made_calls(self) -> bool:
        return self._sent > 0

    def finish_reason(self, engine_reason: str | None, *, streamed: bool = True) -> str | None:
        """vLLM's finish_reason: ``tool_calls`` once calls were made (never for a named
        function); a whole response to ``required`` says so even without calls."""
        plan = self._plan
        if engine_reason != "stop" or plan.named:
            return engine_reason
        if self._sent or (plan.required and not streamed):
            return "tool_calls"
        return engine_reason

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self._harmony is not None:
            self._from_harmony(self._harmony.feed(text), out)
            return out
        if self._reasoning is not None:
            out.reasoning, text = self._reasoning.feed(text)
        self._content(text, out)
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self._harmony is not None:
            self._from_harmony(self._harmony.finish(), out)
            return out
        text = ""
        if self._reasoning is not None:
            out.reasoning, text = self._reasoning.finish()
        self._content(text, out)
        plan = self._plan
        if self._forced is not None:
            return out
        if plan.forced_any:
            self._add(required_calls("".join(self._forced_buf)), out)
            return out
        if self._tools is not None:
            content, calls = self._tools.finish()
            out.content += content
            if not self._plan.discard_calls:
                self._add(calls, out)
        return out

    def _from_harmony(self, piece: HarmonyPiece, out: Parsed) -> None:
        out.reasoning = piece.reasoning
        out.content = piece.content
        if piece.calls and self._plan.report_calls:
            self._add(piece.calls, out)

    def _content(self, text: str, out: Parsed) -> None:
        if not text:
            return
        if self._forced is not None:
            args = self._forced.feed(text)
            if args is None:
                return
            if not self._sent:
                name = self._plan.forced_name or ""
                out.calls.append(CallDelta(0, self._plan.call_id(0, name), name, ""))
                self._sent = 1
            out.calls.append(CallDelta(0, None, None, args))
            return
        if self._plan.forced_any:
            self._forced_buf.append(text)
            return
        if self._tools is None:
            out.content += text
            return
        out.content += self._tools.feed(text)

    def _add(self, calls: list[ToolCall], out: Parsed) -> None:
        plan = self._plan
        for call in calls:
            if plan.single_call and self._sent:
                break
            index = self._sent
            call_id = call.id or plan.call_id(index, call.name)
            out.calls.append(CallDelta(index, call_id, call.name, ""))
            if call.arguments:
                out.calls.append(CallDelta(index, None, None, call.arguments))
            self._sent += 1
