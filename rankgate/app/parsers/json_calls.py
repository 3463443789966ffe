"""Tool-call formats whose calls are JSON objects: Hermes, Llama 3/4 JSON, DeepSeek V3/V3.1 and
xLAM, read as vLLM's parsers read them (same acceptance, same content rules)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rankgate.app.parsers.text import dumps, loads, raw_decode
from rankgate.app.parsers.types import ContentRule, Extracted, ToolCall, ToolContext


def _named(obj: Any, key_order: tuple[str, ...]) -> ToolCall:
    """A ``{"name", <args key>}`` object as a call; raises on anything else."""
    if not isinstance(obj, dict):
        raise TypeError("a call must be a JSON object")
    name = obj["name"]
    if not isinstance(name, str):
        raise TypeError("a call's name must be a string")
    for key in key_order:
        if key in obj:
            return ToolCall(name, dumps(obj[key]))
    raise KeyError(key_order[-1])


@dataclass(frozen=True, slots=True)
class Hermes:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (vLLM's ``hermes``).

    One unparsable call makes the whole output plain content; content is the text before the
    first call.
    """

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    content_rule: ContentRule = "keep"
    json_forcing: bool = False
    engine: bool = False
    rewrites: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.open,)

    def holds_all(self, text: str) -> bool | None:
        return False

    def clean(self, text: str) -> str:
        return text

    def extract(self, text: str, ctx: ToolContext) -> Extracted:
        first = text.find(self.open)
        if first < 0:
            return Extracted(text)
        calls: list[ToolCall] = []
        pos = first
        try:
            while (start := text.find(self.open, pos)) >= 0:
                body_at = start + len(self.open)
                end = text.find(self.close, body_at)
                if end < 0:
                    body, pos = text[body_at:], len(text)
                else:
                    body, pos = text[body_at:end], end + len(self.close)
                calls.append(_named(loads(body), ("arguments",)))
        except (ValueError, TypeError, KeyError):
            return Extracted(text)
        content = text[:first]
        return Extracted(content if content.strip() else None, calls)


@dataclass(frozen=True, slots=True)
class LlamaJson:
    """Llama 3.x/4 JSON calls (``llama3_json``, ``llama4_json``): every ``{`` outside an
    earlier object must start a ``{"name", "arguments"|"parameters"}`` object, else the whole
    output is content; with calls there is no content. Whether text is content depends on the
    whole output, so none streams."""

    bot: str = "<|python_tag|>"
    markers: tuple[str, ...] = ()
    content_rule: ContentRule = "none"
    json_forcing: bool = False
    engine: bool = False
    rewrites: tuple[str, ...] = ()

    def holds_all(self, text: str) -> bool | None:
        return True

    def clean(self, text: str) -> str:
        return text

    def extract(self, text: str, ctx: ToolContext) -> Extracted:
        if self.bot not in text and "{" not in text:
            return Extracted(text)
        calls: list[ToolCall] = []
        end = -1
        pos = text.find("{")
        try:
            while pos >= 0:
                if pos > end:
                    obj, stop = raw_decode(text, pos)
                    end = stop - 1
                    calls.append(_named(obj, ("arguments", "parameters")))
                pos = text.find("{", pos + 1)
        except (ValueError, TypeError, KeyError):
            return Extracted(text)
        return Extracted(None, calls) if calls else Extracted(text)


def deepseek_token(words: str) -> str:
    """DeepSeek's marker spelling: fullwidth bars around words joined by U+2581."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


_DS_CALLS = deepseek_token("tool calls begin")
_DS_CALL = deepseek_token("tool call begin")
_DS_SEP = deepseek_token("tool sep")
_DS_END = deepseek_token("tool call end")
_DS_V3_BLOCK = "\n```json\n"
_DS_V3_CLOSE = "\n```" + _DS_END


class _Next:
    """The next occurrence of ``needle`` at or after a position that only moves forward:
    a search resumes where the last one stopped, so all of them together read the text once."""

    __slots__ = ("_at", "_needle", "_text")

    def __init__(self, text: str, needle: str) -> None:
        self._text = text
        self._needle = needle
        self._at = -2  # -1: none left; -2: not looked for yet

    def after(self, start: int) -> int:
        if self._at != -1 and self._at < start:
            self._at = self._text.find(self._needle, start)
        return self._at


def _v31_calls(text: str) -> list[ToolCall]:
    r"""What ``findall`` of ``CALL([^\n]*?)SEP([^\n]*?)END`` returns, in one pass: the name
    runs to the first separator after the call marker and the arguments to the first end
    marker after that, both on the marker's line. (The regex itself rescans the rest of the
    line from every call marker, and from every separator after it.)"""
    calls: list[ToolCall] = []
    newline, sep, end = _Next(text, "\n"), _Next(text, _DS_SEP), _Next(text, _DS_END)
    at = text.find(_DS_CALL)
    while at >= 0:
        name_at = at + len(_DS_CALL)
        line_end = newline.after(name_at)
        line_end = len(text) if line_end < 0 else line_end
        sep_at = sep.after(name_at)
        if sep_at < 0:
            break
        if sep_at < line_end:
            args_at = sep_at + len(_DS_SEP)
            end_at = end.after(args_at)
            if end_at < 0:
                break
            if end_at < line_end:
                calls.append(ToolCall(text[name_at:sep_at], text[args_at:end_at]))
                at = text.find(_DS_CALL, end_at + len(_DS_END))
                continue
        at = text.find(_DS_CALL, at + 1)
    return calls


def _v3_calls(text: str) -> list[tuple[str, str, str]]:
    r"""What ``findall`` of ``CALL([^\n]*)SEP([^\n]*)\n```json\n([^\n]*)\n```END`` returns
    (type, name, arguments), in one pass: the type runs to the last separator of the marker's
    line, the name to the line's end, and the arguments are the next line. What follows a line
    is looked at once per line, not once per call marker on it."""
    found: list[tuple[str, str, str]] = []
    newline = _Next(text, "\n")
    # The line last looked at: its end, where its arguments line ends (-1: the json block
    # does not follow), and its last separator after the first call marker looked at.
    line_end, args_end, last_sep = -1, -1, -1
    at = text.find(_DS_CALL)
    while at >= 0:
        kind_at = at + len(_DS_CALL)
        if kind_at > line_end:
            line_end = newline.after(kind_at)
            if line_end < 0:
                break
            args_end = -1
            if text.startswith(_DS_V3_BLOCK, line_end):
                stop = text.find("\n", line_end + len(_DS_V3_BLOCK))
                if stop >= 0 and text.startswith(_DS_V3_CLOSE, stop):
                    args_end = stop
            last_sep = text.rfind(_DS_SEP, kind_at, line_end) if args_end >= 0 else -1
        if args_end >= 0 and last_sep >= kind_at:
            found.append(
                (
                    text[kind_at:last_sep],
                    text[last_sep + len(_DS_SEP) : line_end],
                    text[line_end + len(_DS_V3_BLOCK) : args_end],
                )
            )
            at = text.find(_DS_CALL, args_end + len(_DS_V3_CLOSE))
            continue
        at = text.find(_DS_CALL, at + 1)
    return found


@dataclass(frozen=True, slots=True)
class DeepSeek:
    """DeepSeek V3 (``deepseek_v3``: type, name and a json code block) and V3.1
    (``deepseek_v31``: name and raw arguments) calls inside a calls section. Arguments are
    passed on as written; calls that do not match are dropped, and content is the text before
    the section."""

    v31: bool = False
    content_rule: ContentRule = "keep"
    json_forcing: bool = False
    engine: bool = False
    rewrites: tuple[str, ...] = ()

    @property
    def markers(self) -> tuple[str, ...]:
        return (_DS_CALLS,)

    def holds_all(self, text: str) -> bool | None:
        return False

    def clean(self, text: str) -> str:
        return text

    def extract(self, text: str, ctx: ToolContext) -> Extracted:
        first = text.find(_DS_CALLS)
        if first < 0:
            return Extracted(text)
        calls: list[ToolCall] = []
        if self.v31:
            calls = _v31_calls(text)
        else:
            for kind, name, args in _v3_calls(text):
                if kind != "function":
                    return Extracted(text)
                calls.append(ToolCall(name, args))
        content = text[:first]
        return Extracted(content if content.strip() else None, calls, called=True)


@dataclass(frozen=True, slots=True)
class _Blocks:
    r"""What ``re.compile(open + r"([\s\S]*?)" + close)`` finds (after an optional ``lead``
    word and whitespace), found in one pass: the regex would scan to the end from each
    opener that has no closer, time that grows with the square of the output."""

    opener: str
    closer: str
    lead: str = ""
    # The regex's ``\s*`` after the opener (and lead).
    skip_space: bool = False

    def spans(self, text: str) -> list[tuple[int, int, int, int]]:
        """(match start, match end, body start, body end) of each block, in order."""
        found = []
        at = text.find(self.opener)
        while at >= 0:
            body = at + len(self.opener)
            if self.lead and text.startswith(self.lead, body):
                body += len(self.lead)
            while self.skip_space and body < len(text) and text[body].isspace():
                body += 1
            if self.closer:
                end = text.find(self.closer, body)
                if end < 0:
                    break
                stop = end + len(self.closer)
            else:
                end = text.find("\n", body)
                end = stop = len(text) if end < 0 else end
            found.append((at, stop, body, end))
            at = text.find(self.opener, stop)
        return found

    def findall(self, text: str) -> list[str]:
        return [text[body:end] for _, _, body, end in self.spans(text)]

    def sub(self, text: str) -> str:
        kept, last = [], 0
        for start, stop, _, _ in self.spans(text):
            kept.append(text[last:start])
            last = stop
        kept.append(text[last:])
        return "".join(kept)


_XLAM_BLOCKS = (
    _Blocks("```", "```", lead="json", skip_space=True),
    _Blocks("[TOOL_CALLS]", ""),
    _Blocks("<tool_call>", "</tool_call>"),
)
_XLAM_AFTER_THINK = re.compile(r"</think>([\s\S]*)")


def _parses(text: str) -> bool:
    try:
        loads(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Xlam:
    """xLAM (``xlam``): a JSON array of ``{"name", "arguments"}``, bare, after ``</think>``, or
    in a json code block, ``[TOOL_CALLS]`` line or ``<tool_call>`` tag."""

    markers: tuple[str, ...] = ()
    content_rule: ContentRule = "keep"
    json_forcing: bool = True
    engine: bool = False
    rewrites: tuple[str, ...] = ()

    def holds_all(self, text: str) -> bool | None:
        return True

    def clean(self, text: str) -> str:
        return text

    def _split(self, text: str) -> tuple[str | None, str | None]:
        """(content, the JSON text that may hold the calls)."""
        think = _XLAM_AFTER_THINK.search(text)
        if think:
            content = text[: think.start() + len("</think>")].strip()
            rest = think.group(1).strip()
            if _parses(rest):
                return content, rest
            for pattern in _XLAM_BLOCKS:
                for block in pattern.findall(rest):
                    if _parses(block):
                        return content, block
        for pattern in _XLAM_BLOCKS:
            for block in pattern.findall(text):
                if _parses(block):
                    return pattern.sub(text).strip(), block
        looks_like_calls = "{" in text and "name" in text and "arguments" in text
        if text.strip().startswith("[") and (_parses(text) or looks_like_calls):
            return None, text
        return text, None

    def extract(self, text: str, ctx: ToolContext) -> Extracted:
        content, candidate = self._split(text)
        if not candidate:
            return Extracted(content)
        try:
            data = loads(candidate)
        except ValueError:
            return Extracted(text)
        if not isinstance(data, list):
            return Extracted(content or text)
        calls: list[ToolCall] = []
        for item in data:
            if not isinstance(item, dict) or "name" not in item or "arguments" not in item:
                continue
            name, args = item["name"], item["arguments"]
            if not isinstance(name, str) or not isinstance(args, dict | str):
                return Extracted(text)
            calls.append(ToolCall(name, dumps(args) if isinstance(args, dict) else args))
        return Extracted(content, calls)


def _mistral_calls(parsed: Any) -> list[ToolCall]:
    if isinstance(parsed, dict):
        parsed = [parsed]
    if not isinstance(parsed, list):
        return []
    calls: list[ToolCall] = []
    for item in parsed:
        if not isinstance(item, dict) or not ("name" in item or "arguments" in item):
            continue
        name = item.get("name")
        args = item.get("arguments")
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = dumps(args)
        calls.append(ToolCall(name if isinstance(name, str) else "", args))
    return calls


@dataclass(frozen=True, slots=True)
class MistralJson:
    """Mistral before tokenizer v11 (``mistral`` with no ``[ARGS]`` token):
    ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

    When the JSON after the marker holds no call, vLLM answers with that JSON alone as the
    content, so no content is final before the output ends.
    """

    bot: str = "[TOOL_CALLS]"
    # tool_choice required/named: vLLM reads a bare array without the marker.
    forced: bool = False
    markers: tuple[str, ...] = ()
    content_rule: ContentRule = "keep"
    json_forcing: bool = False
    engine: bool = True
    rewrites: tuple[str, ...] = ()

    def holds_all(self, text: str) -> bool | None:
        return True

    def clean(self, text: str) -> str:
        return text

    def extract(self, text: str, ctx: ToolContext) -> Extracted:
        prefix: str | None = None
        if self.bot in text:
            prefix, *segments = text.split(self.bot)
            payload = next((s.strip() for s in segments if s.strip()), "")
        elif self.forced:
            payload = text.strip()
        else:
            return Extracted(text)
        parsed: Any = None
        try:
            parsed, _ = raw_decode(payload)
        except ValueError:
            # What the regex ``\[{.*}\]`` (dot-all) matches first: from the first "[{" to
            # the last "}]", found without its backtracking from every "[{".
            start, end = payload.find("[{"), payload.rfind("}]")
            if start >= 0 and end >= start + 2:
                try:
                    parsed = loads(payload[start : end + 2])
                except ValueError:
                    parsed = None
        calls = _mistral_calls(parsed)
        if not calls:
            return Extracted(payload or None)
        return Extracted(prefix if prefix and prefix.strip() else None, calls)
