"""gpt-oss's harmony channels (vLLM's ``openai`` tool parser and ``openai_gptoss`` reasoning).

The output is a sequence of messages, each ``<|channel|>NAME [to=RECIPIENT] [<|constrain|>TYPE]
<|message|>TEXT`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``. The ``analysis`` channel
is reasoning, ``final`` (and ``commentary`` to no one) is the answer, and a message to
``functions.NAME`` is a call. The ``openai-harmony`` library (the one vLLM uses) does the
parsing; it reads token ids of the o200k harmony vocabulary, which gpt-oss's text encodes to
exactly, so text from any detokenizer works.

Streaming releases answer and reasoning text as each message grows, a call once its message
is complete, and whatever is left unparsed when the output ends, as vLLM does with a whole output.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from openai_harmony import (
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Role,
    StreamableParser,
    load_harmony_encoding,
)

from rankgate.app.parsers.text import loads, partial_suffix
from rankgate.app.parsers.types import ToolCall

_BUILTIN = frozenset({"python", "browser", "container"})


@functools.cache
def encoding() -> HarmonyEncoding:
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@functools.cache
def _special_ids() -> dict[str, int]:
    enc = encoding()
    return {
        t: enc.encode(t, allowed_special={t}, disallowed_special=())[0]
        for t in enc.special_tokens_set
    }


# Where a special token may be: every one of the vocabulary's is "<|", a name, "|>".
_SPECIAL = re.compile(r"<\|[a-z0-9_]+\|>")


def _encode(enc: HarmonyEncoding, text: str) -> list[int]:
    """``enc.encode(text, allowed_special="all")``: the special tokens, and the text between
    them encoded on its own, as the encoder splits it. The encoder's own way hands it all
    thousand special tokens on every call, most of the time a delta takes."""
    ids: list[int] = []
    specials = _special_ids()
    pos = 0
    for found in _SPECIAL.finditer(text):
        token = specials.get(found.group())
        if token is None:
            continue
        if found.start() > pos:
            ids += enc.encode(text[pos : found.start()], disallowed_special=())
        ids.append(token)
        pos = found.end()
    if pos < len(text):
        ids += enc.encode(text[pos:], disallowed_special=())
    return ids


@functools.cache
def _stop_tokens() -> frozenset[int]:
    return frozenset(encoding().stop_tokens())


@functools.cache
def _markers() -> tuple[str, ...]:
    return tuple(sorted(t for t in encoding().special_tokens_set if t.startswith("<|")))


def _recipient(value: str | None) -> str | None:
    if value is None:
        return None
    at = value.find("<|constrain|>")
    if at < 0:
        return value
    return value[:at].rstrip() or None


def _is_function(recipient: str | None) -> bool:
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient not in _BUILTIN and recipient.split(".", 1)[0] not in _BUILTIN


def _kind(channel: str | None, recipient: str | None) -> str:
    if _is_function(recipient):
        return "tool"
    if channel == "analysis":
        return "reasoning"
    if channel == "final" or (channel == "commentary" and recipient is None):
        return "content"
    return "ignore"


def _arguments(text: str, content_type: str | None) -> str:
    if content_type is not None and "json" not in content_type:
        return text
    try:
        return json.dumps(loads(text))
    except ValueError:
        return text


@dataclass(slots=True)
class HarmonyPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] | None = None


class HarmonyStream:
    """One choice's harmony parser: feed text, get what is settled."""

    __slots__ = (
        "_enc",
        "_held",
        "_parser",
        "_reasoning_on",
        "_seen",
        "_sent_content",
        "_sent_reasoning",
        "_started",
        "_tokens",
        "_tools_on",
    )

    def __init__(self, *, reasoning: bool, tools: bool) -> None:
        self._enc = encoding()
        # A piece may end inside a marker ("<|chan"): held until the marker is whole.
        self._held = ""
        self._parser = StreamableParser(self._enc, role=Role.ASSISTANT)
        self._reasoning_on = reasoning
        self._tools_on = tools
        # Tokens of the message being read (what vLLM recovers if the output ends mid-header).
        self._tokens: list[int] = []
        self._seen = 0
        # Whether some text of the current message was released, and whether any reasoning or
        # content was released before (the next message of that kind then starts with "\n").
        self._started = False
        self._sent_reasoning = False
        self._sent_content = False

    def feed(self, text: str) -> HarmonyPiece:
        out = HarmonyPiece()
        text = self._held + text
        keep = partial_suffix(text, _markers())
        text, self._held = text[: len(text) - keep], text[len(text) - keep :]
        if text:
            self._process(text, out)
        return out

    def _process(self, text: str, out: HarmonyPiece) -> None:
        parser = self._parser
        stops = _stop_tokens()
        for token in _encode(self._enc, text):
            try:
                parser.process(token)
            except HarmonyError:
                continue
            # Only a stop token ends a message; ``messages`` converts every message the
            # parser holds, so it is read then, from a parser that holds only this one.
            if token in stops and len(parser.messages) > self._seen:
                self._tokens.clear()
                self._completed(out)
                parser = self._restart()
                continue
            self._tokens.append(token)
            delta = parser.last_content_delta
            if delta:
                self._delta(
                    parser.current_channel, _recipient(parser.current_recipient), delta, out
                )

    def finish(self) -> HarmonyPiece:
        out = HarmonyPiece()
        held, self._held = self._held, ""
        if held:
            self._process(held, out)
        try:
            self._parser.process_eos()
        except HarmonyError:
            text = self._enc.decode(self._tokens)
            if text:
                self._started = False
                self._delta("final", None, text, out)
            return out
        if len(self._parser.messages) > self._seen:
            self._completed(out)
        return out

    def _restart(self) -> StreamableParser:
        """A fresh parser in the state a completed message leaves (expecting ``<|start|>``,
        no role carried over), so the messages it holds stay one at a time."""
        self._parser = StreamableParser(self._enc, role=None)
        self._seen = 0
        return self._parser

    def _delta(
        self, channel: str | None, recipient: str | None, text: str, out: HarmonyPiece
    ) -> None:
        kind = _kind(channel, recipient)
        if kind == "reasoning" and self._reasoning_on:
            if not self._started and self._sent_reasoning:
                out.reasoning += "\n"
            out.reasoning += text
            self._sent_reasoning = self._started = True
        elif kind == "content":
            if not self._started and self._sent_content:
                out.content += "\n"
            out.content += text
            self._sent_content = self._started = True

    def _completed(self, out: HarmonyPiece) -> None:
        for message in self._parser.messages[self._seen :]:
            self._seen += 1
            self._started = False
            recipient = _recipient(message.recipient)
            if (
                message.author.role != Role.ASSISTANT
                or not message.content
                or _kind(message.channel, recipient) != "tool"
                or not self._tools_on
            ):
                continue
            assert recipient is not None
            text = message.content[0].text
            call = ToolCall(
                recipient.removeprefix("functions."),
                _arguments(text, message.content_type),
            )
            out.calls = [*(out.calls or []), call]
