"""Deterministic token generation and everything vLLM decides per output token.

A request's tokens depend only on its prompt, LoRA and sampling seed (or on fresh entropy when
it samples without a seed, as a real sampler would). Stop ids, stop strings, EOS, min/max
tokens, the stop-string hold-back while streaming and the finish reasons follow vLLM's
semantics so clients see the same shapes they would see from a GPU.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass
from enum import IntEnum

from mocker.vocab import TextStream, Vocabulary


class Finish(IntEnum):
    """Values match ``FinishInfo.FinishReason`` on the wire."""

    NOT_FINISHED = 0
    LENGTH = 1
    STOP = 2
    ABORTED = 3


@dataclass(frozen=True, slots=True)
class LogprobSpec:
    """What to report per output token: the sampled token, plus ``top_n`` or fixed ids."""

    top_n: int = 0
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    seed_material: bytes
    max_tokens: int
    min_tokens: int
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    include_stop_strings: bool
    ignore_eos: bool
    skip_special_tokens: bool
    logprobs: LogprobSpec | None
    want_text: bool
    eos_probability: float


@dataclass(slots=True)
class TokenInfo:
    token_id: int
    logprob: float
    rank: int
    # (id, logprob, rank) of the candidates at this position.
    candidates: tuple[tuple[int, float, int], ...]


@dataclass(slots=True)
class Emitted:
    """What one step adds to a sequence's output: text delta and, at the end, the finish."""

    token_id: int
    text: str
    info: TokenInfo | None
    finish: Finish
    stop_reason: int | str | None
    eos: bool


def seed_material(prompt: list[int], lora: str, seed: int | None, temperature: float) -> bytes:
    """Greedy and seeded requests repeat exactly; unseeded sampling draws fresh entropy."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(len(prompt).to_bytes(4, "little"))
    digest.update(b"".join(t.to_bytes(4, "little") for t in prompt[-256:]))
    digest.update(lora.encode())
    if temperature > 0.0:
        digest.update(os.urandom(16) if seed is None else seed.to_bytes(8, "little", signed=True))
    return digest.digest()


class Sequence:
    """The output side of one request: sampler state, text so far and stop detection."""

    __slots__ = (
        "_held",
        "_rng",
        "_stream",
        "_text",
        "done",
        "num_tokens",
        "spec",
        "token_ids",
        "vocab",
    )

    def __init__(self, spec: SamplingSpec, vocab: Vocabulary) -> None:
        self.spec = spec
        self.vocab = vocab
        self._rng = random.Random(spec.seed_material)
        self._stream: TextStream | None = (
            vocab.text_stream(spec.skip_special_tokens)
            if spec.want_text or spec.stop_strings
            else None
        )
        self._text = ""
        self._held = 0
        self.token_ids: list[int] = []
        self.num_tokens = 0
        self.done = False

    def next_token(self) -> Emitted:
        """Sample one token and apply every stop rule; the caller enforces length limits."""
        spec = self.spec
        pool = self.vocab.output_ids
        u_eos = self._rng.random()
        index = int(self._rng.random() * len(pool))
        may_stop = self.num_tokens >= spec.min_tokens
        if not spec.ignore_eos and may_stop and u_eos < spec.eos_probability:
            token = self.vocab.eos_token_id
        else:
            token = pool[index]
            if not may_stop and token in spec.stop_token_ids:
                token = self._avoid_stop(index)
        self.num_tokens += 1
        self.token_ids.append(token)
        info = self._logprobs(token, index) if spec.logprobs is not None else None

        is_eos = token == self.vocab.eos_token_id and not spec.ignore_eos
        if (is_eos or token in spec.stop_token_ids) and may_stop:
            self.done = True
            text = ""
            if spec.include_stop_strings and self._stream is not None:
                self._text += self._stream.step(token)
            text = self._flush(final=True)
            stop: int | str = token
            return Emitted(token, text, info, Finish.STOP, None if is_eos else stop, is_eos)

        if self._stream is None:
            return self._finish_if_full(token, "", info)
        start = len(self._text)
        self._text += self._stream.step(token)
        if spec.stop_strings and self.num_tokens > spec.min_tokens:
            hit = self._find_stop(start)
            if hit is not None:
                position, matched = hit
                end = position + len(matched) if spec.include_stop_strings else position
                self._text = self._text[:end]
                self.done = True
                return Emitted(token, self._flush(final=True), info, Finish.STOP, matched, False)
        return self._finish_if_full(token, self._flush(final=False), info)

    def finish_length(self) -> str:
        """End for length; returns the text still held back for stop-string matching."""
        self.done = True
        return self._flush(final=True)

    def _finish_if_full(self, token: int, text: str, info: TokenInfo | None) -> Emitted:
        if self.num_tokens >= self.spec.max_tokens:
            self.done = True
            return Emitted(token, text + self._flush(final=True), info, Finish.LENGTH, None, False)
        return Emitted(token, text, info, Finish.NOT_FINISHED, None, False)

    def _avoid_stop(self, index: int) -> int:
        pool = self.vocab.output_ids
        for offset in range(1, len(pool)):
            candidate = pool[(index + offset) % len(pool)]
            if candidate not in self.spec.stop_token_ids:
                return candidate
        return pool[index]

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.spec.stop_strings:
            position = self._text.find(stop, max(0, start - len(stop) + 1))
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _flush(self, final: bool) -> str:
        """Release text, holding back what could still grow into a stop string (vLLM does)."""
        if not self.spec.want_text:
            return ""
        hold = 0
        if not final and self.spec.stop_strings and not self.spec.include_stop_strings:
            hold = max(len(s) for s in self.spec.stop_strings) - 1
        end = max(self._held, len(self._text) - hold)
        piece = self._text[self._held : end]
        self._held = end
        return piece

    def _logprobs(self, token: int, index: int) -> TokenInfo:
        spec = self.spec.logprobs
        assert spec is not None
        pool = self.vocab.output_ids
        sampled = -0.05 - ((index * 2654435761) % 1000) / 800.0
        if spec.token_ids:
            candidates = tuple(
                (t, sampled, 1) if t == token else (t, sampled - 1.0 - (t % 97) / 50.0, 2 + n)
                for n, t in enumerate(spec.token_ids)
            )
            return TokenInfo(token, sampled, 1, candidates)
        top: list[tuple[int, float, int]] = []
        if spec.top_n:
            top.append((token, sampled, 1))
            step = 0
            while len(top) < spec.top_n and step < len(pool):
                step += 1
                candidate = pool[(index + step * 7) % len(pool)]
                if candidate != token and all(candidate != t for t, _, _ in top):
                    top.append((candidate, sampled - 0.25 * len(top), len(top) + 1))
        return TokenInfo(token, sampled, 1, tuple(top))
