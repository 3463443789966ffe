"""Reasoning splitters, one per family of vLLM reasoning parsers.

Each splits a stream into reasoning and answer so that the pieces add up to vLLM's split of
the whole output. Where a later marker could still re-split text already seen (vLLM's
non-streamed rules look at the whole output), that text is held, not guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rankgate.app.parsers.text import TagScan, partial_suffix

THINK = "<think>"
END_THINK = "</think>"


class PrefixThink:
    """``deepseek_r1``: everything up to the first ``<think>`` is dropped; reasoning runs to the
    first ``</think>``, or to the end when there is none.

    Until a ``<think>`` is seen, a later one could still drop all text before it, so that
    text is held; after it, reasoning streams.
    """

    __slots__ = ("_buf", "_held", "_state")

    def __init__(self) -> None:
        self._state = "pre"  # "pre" (no <think> yet), "in", "out"
        self._buf = ""
        # Before a <think>: everything held, in pieces (joined once, when it is needed).
        self._held: list[str] = []

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == "pre":
            # Only the end of what is held can start a <think> that this text completes.
            tail = self._buf
            probe = tail + text
            at = probe.find(THINK)
            if at < 0:
                self._held.append(text)
                self._buf = probe[-(len(THINK) - 1) :]
                return "", ""
            self._state = "in"
            self._held = []
            buf = probe[at + len(THINK) :]
        else:
            buf = self._buf + text
        if self._state == "out":
            self._buf = ""
            return "", buf
        at = buf.find(END_THINK)
        if at >= 0:
            self._state = "out"
            self._buf = ""
            return buf[:at], buf[at + len(END_THINK) :]
        keep = partial_suffix(buf, (END_THINK,))
        self._buf = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "out":
            return "", buf
        if self._state == "in":
            return buf, ""
        buf, self._held = "".join(self._held), []
        reasoning, found, content = buf.partition(END_THINK)
        return (reasoning, content) if found else (buf, "")


class EndThink:
    """``step3``: reasoning is everything before the first ``</think>`` (or everything)."""

    __slots__ = ("_held", "_out")

    def __init__(self) -> None:
        self._out = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self._out:
            return "", text
        buf = self._held + text
        at = buf.find(END_THINK)
        if at >= 0:
            self._out = True
            self._held = ""
            return buf[:at], buf[at + len(END_THINK) :]
        keep = partial_suffix(buf, (END_THINK,))
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return ("", held) if self._out else (held, "")


_GRANITE_THOUGHT = re.compile(r"(?:Here's|Here is) my thought process:")
_GRANITE_RESPONSE = re.compile(r"(?:Here's|Here is) my response:")
# Longer than either phrase.
_PHRASE = 32


class GraniteThought:
    """``granite``: "Here is my thought process: ... Here is my response: ..."; an output
    without both phrases is all answer, so nothing is released before the second one.

    What is held is kept in pieces and each phrase looked for only where new text could have
    completed it, so a long output without the phrases costs time in proportion to it."""

    __slots__ = ("_out", "_pieces", "_size", "_tail", "_thought_end")

    def __init__(self) -> None:
        self._out = False
        self._pieces: list[str] = []
        self._size = 0
        self._tail = ""
        # Where the thought phrase ends in the whole output, once found.
        self._thought_end = -1

    def feed(self, text: str) -> tuple[str, str]:
        if self._out:
            return "", text
        window = self._tail + text
        base = self._size - len(self._tail)
        self._pieces.append(text)
        self._size += len(text)
        self._tail = window[-_PHRASE:]
        if self._thought_end < 0:
            thought = _GRANITE_THOUGHT.search(window)
            if thought is None:
                return "", ""
            self._thought_end = base + thought.end()
        response = _GRANITE_RESPONSE.search(window, max(0, self._thought_end - base))
        if response is None:
            return "", ""
        self._out = True
        buf = "".join(self._pieces)
        self._pieces = []
        return buf[self._thought_end : base + response.start()], buf[base + response.end() :]

    def finish(self) -> tuple[str, str]:
        buf = "".join(self._pieces)
        self._pieces = []
        return "", buf


@dataclass(frozen=True, slots=True)
class MarkupConfig:
    """A marker machine in the style of vLLM's engine-based reasoning parsers."""

    start: str
    end: str
    starts_inside: bool
    # Markers that end reasoning implicitly and stay in the answer (a tool call's opener).
    implicit_ends: tuple[str, ...] = ()
    # Whether a start marker in the answer opens reasoning again.
    reopens: bool = False
    strip_trailing: bool = True
    # Other markers the format knows: they are text here, but never taken for drops.
    known: tuple[str, ...] = ()


class MarkupThink:
    """Engine-style splitting: start/end markers switch state and are consumed (a repeated one
    is dropped); special tokens the format does not know are dropped; reasoning may lose its
    trailing whitespace at the end, so that whitespace is held until more reasoning follows."""

    __slots__ = ("_config", "_drops", "_held", "_reasoning", "_space", "_tags")

    def __init__(self, config: MarkupConfig, special: frozenset[str]) -> None:
        self._config = config
        known = {config.start, config.end, *config.implicit_ends, *config.known}
        self._drops = tuple(sorted(special - known))
        self._tags = (config.start, config.end, *config.implicit_ends, *self._drops)
        self._reasoning = config.starts_inside
        self._held = ""
        # Reasoning's trailing whitespace, held in pieces (a long run would be copied whole
        # at every delta if it were one string).
        self._space: list[str] = []

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        keep = partial_suffix(buf, self._tags)
        self._held = buf[len(buf) - keep :]
        return self._scan(buf[: len(buf) - keep])

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        reasoning, content = self._scan(held)
        if not self._config.strip_trailing:
            reasoning += "".join(self._space)
        self._space = []
        return reasoning, content

    def _scan(self, buf: str) -> tuple[str, str]:
        config = self._config
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        scan = TagScan(buf, self._tags)
        while pos < len(buf):
            at, tag = scan.first(pos)
            stop = at if at >= 0 else len(buf)
            (reasoning if self._reasoning else content).append(buf[pos:stop])
            if at < 0:
                break
            pos = at + len(tag)
            if tag == config.start:
                if not self._reasoning and not config.reopens:
                    content.append(tag)
                self._reasoning = self._reasoning or config.reopens
            elif tag == config.end:
                self._reasoning = False
            elif tag in config.implicit_ends:
                if self._reasoning:
                    self._reasoning = False
                content.append(tag)
        return self._trail("".join(reasoning)), "".join(content)

    def _trail(self, reasoning: str) -> str:
        """Hold reasoning's trailing whitespace until non-blank reasoning follows."""
        if not reasoning:
            return ""
        body = reasoning.rstrip()
        if not body:
            self._space.append(reasoning)
            return ""
        held = "".join(self._space)
        self._space = [reasoning[len(body) :]]
        return held + body


class Plain:
    """No reasoning in this output (a thinking switch turned it off): everything is answer."""

    __slots__ = ()

    def feed(self, text: str) -> tuple[str, str]:
        return "", text

    def finish(self) -> tuple[str, str]:
        return "", ""
