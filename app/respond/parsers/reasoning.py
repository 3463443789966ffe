"""Splitting ``<think>…</think>`` reasoning from the answer, incrementally.

The same state machine serves streaming and non-streaming responses, so both always agree.
A tag split across deltas is held back until it can be told apart from ordinary text.
"""

from __future__ import annotations

START = "<think>"
END = "</think>"

# Parser names as vLLM spells them; ``True`` when the model starts inside the reasoning (its
# template opened ``<think>`` in the prompt), so text before ``</think>`` is reasoning even
# without an opening tag.
PARSERS: dict[str, bool] = {
    "deepseek_r1": True,
    "qwen3": False,
    "think": False,
}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ReasoningParser:
    """Feed generated text; get back (reasoning, content) pieces."""

    __slots__ = ("_held", "_state")

    def __init__(self, starts_inside: bool) -> None:
        # "open": nothing decided yet; "in": inside reasoning; "out": answer text.
        self._state = "open"
        self._held = ""
        if starts_inside:
            self._state = "open-in"

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self._state in ("open", "open-in"):
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    self._state = "in"
                    buf = stripped[len(START) :]
                    continue
                if START.startswith(stripped):
                    self._held = buf
                    break
                self._state = "in" if self._state == "open-in" else "out"
                continue
            if self._state == "in":
                at = buf.find(END)
                if at >= 0:
                    reasoning.append(buf[:at])
                    buf = buf[at + len(END) :]
                    self._state = "out"
                    continue
                keep = _partial_suffix(buf, END)
                reasoning.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                break
            content.append(buf)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "in" or self._state == "open-in":
            return held, ""
        return "", held
