"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Used by Hermes, Qwen 2.5/3 and many fine-tunes (vLLM's ``hermes`` parser). Text outside the
tags is content; each complete tag becomes a tool call; a tag whose body is not a JSON call
stays content, so nothing the model wrote is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from app.respond.parsers.reasoning import _partial_suffix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
PARSERS = frozenset({"hermes", "qwen3_coder_hermes", "qwen25"})


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str


def parse_call(body: str) -> ParsedCall | None:
    """A ``{"name", "arguments"|"parameters"}`` object, arguments re-encoded as JSON text."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        return ParsedCall(value["name"], args)
    return ParsedCall(value["name"], orjson.dumps(args).decode())


class HermesToolParser:
    __slots__ = ("_calls", "_held", "_inside", "_space")

    def __init__(self) -> None:
        self._inside = False
        self._held = ""
        self._calls = 0
        # Whitespace after a call, held until real text follows (then it is content) or
        # another call or the end does (then it was layout and is dropped).
        self._space = ""

    @property
    def calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        buf = self._held + text
        self._held = ""
        content: list[str] = []
        calls: list[ParsedCall] = []
        while buf:
            if not self._inside:
                at = buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(buf, OPEN)
                    self._emit(buf[: len(buf) - keep], content)
                    self._held = buf[len(buf) - keep :]
                    break
                self._emit(buf[:at], content)
                self._space = ""
                buf = buf[at + len(OPEN) :]
                self._inside = True
                continue
            at = buf.find(CLOSE)
            if at < 0:
                self._held = buf
                break
            self._close(buf[:at], content, calls, closed=True)
            buf = buf[at + len(CLOSE) :]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, ""
        content: list[str] = []
        calls: list[ParsedCall] = []
        if self._inside:
            self._close(held, content, calls, closed=False)
        else:
            self._emit(held, content)
        self._space = ""
        return "".join(content), calls

    def _emit(self, text: str, content: list[str]) -> None:
        if not text:
            return
        if self._calls:
            if not text.strip():
                self._space += text
                return
            text, self._space = self._space + text, ""
        content.append(text)

    def _close(
        self, body: str, content: list[str], calls: list[ParsedCall], *, closed: bool
    ) -> None:
        self._inside = False
        call = parse_call(body.strip())
        if call is None:
            content.append(OPEN + body + (CLOSE if closed else ""))
            return
        self._calls += 1
        calls.append(call)
