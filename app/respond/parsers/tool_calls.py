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
    __slots__ = ("_calls", "_held", "_inside")

    def __init__(self) -> None:
        self._inside = False
        self._held = ""
        self._calls = 0

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
                    content.append(buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                content.append(buf[:at])
                buf = buf[at + len(OPEN) :]
                self._inside = True
                continue
            at = buf.find(CLOSE)
            if at < 0:
                self._held = buf
                break
            self._close(buf[:at], content, calls, closed=True)
            buf = buf[at + len(CLOSE) :]
        return self._trim("".join(content)), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, ""
        content: list[str] = []
        calls: list[ParsedCall] = []
        if self._inside:
            self._close(held, content, calls, closed=False)
        else:
            content.append(held)
        return self._trim("".join(content)), calls

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

    def _trim(self, content: str) -> str:
        # Whitespace between or after calls is layout, not an answer.
        if self._calls and not content.strip():
            return ""
        return content
