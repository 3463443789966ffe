"""One request's output: tokens from the model, and everything vLLM decides per token.

Tokens depend only on the prompt, LoRA and sampling seed (or on fresh entropy when sampling
without a seed, as a real sampler would). Stop ids, stop strings, EOS, min/max tokens, the
min-tokens mask, the stop-string hold-back while streaming and the finish reasons follow
vLLM's semantics, so clients see the shapes they would see from a GPU.
"""

from __future__ import annotations

import hashlib
import random
import sys
from array import array
from dataclasses import dataclass
from enum import IntEnum

from rankgate.mocker.model import Processing, TokenModel
from rankgate.mocker.vocab import TextStream, Vocabulary

_NOTHING: frozenset[int] = frozenset()
_BIG_ENDIAN = sys.byteorder == "big"
# Seeded from the OS once; a draw per request needs no system call.
_ENTROPY = random.Random()


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
    context_key: int
    sample_seed: bytes
    processing: Processing
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
    # Structured output: the tokens of the conforming answer, then EOS.
    forced: tuple[int, ...] | None = None


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


def context_key(prompt: list[int], lora: str, model_seed: int, end: int | None = None) -> int:
    """The model's context: the same prompt under the same adapter continues the same way.

    ``end`` keys the prompt's first ``end`` tokens without copying them."""
    if end is None:
        end = len(prompt)
    digest = hashlib.blake2b(digest_size=8, salt=model_seed.to_bytes(8, "little", signed=True))
    digest.update(end.to_bytes(4, "little"))
    tail = array("I", prompt[max(0, end - 512) : end])
    if _BIG_ENDIAN:
        tail.byteswap()
    digest.update(tail)
    digest.update(lora.encode())
    return int.from_bytes(digest.digest(), "little")


def prompt_logprobs(
    model: TokenModel, prompt: list[int], lora: str, model_seed: int, top_n: int
) -> list[TokenInfo]:
    """Each prompt token after the first, scored as the model would score it as the first
    output after the tokens before it: prompt and output logprobs come from one model.

    Costs a context hash per position, so it is computed only when asked for.
    """
    infos: list[TokenInfo] = []
    for position in range(1, len(prompt)):
        ctx = TokenModel.context(context_key(prompt, lora, model_seed, position), 0)
        token = prompt[position]
        rank = model.rank_of(ctx, token)
        candidates = tuple(
            (model.token_at(ctx, k), model.raw_logprob(k), k) for k in range(1, top_n + 1)
        )
        infos.append(TokenInfo(token, model.raw_logprob(rank), rank, candidates))
    return infos


def sample_seed(key: int, seed: int | None) -> bytes:
    """Seeded sampling repeats exactly; unseeded sampling draws fresh entropy."""
    if seed is None:
        return _ENTROPY.randbytes(16)
    return key.to_bytes(8, "little") + seed.to_bytes(8, "little", signed=True)


class Sequence:
    """Sampler state, text so far and stop detection for one request."""

    __slots__ = ("_held", "_rng", "_stream", "_text", "model", "num_tokens", "spec", "vocab")

    def __init__(self, spec: SamplingSpec, vocab: Vocabulary, model: TokenModel) -> None:
        self.spec = spec
        self.vocab = vocab
        self.model = model
        self._rng: random.Random | None = None
        self._stream: TextStream | None = (
            vocab.text_stream(spec.skip_special_tokens)
            if spec.want_text or spec.stop_strings
            else None
        )
        self._text = ""
        self._held = 0
        self.num_tokens = 0

    def next_token(self) -> Emitted:
        """Produce one token and apply every stop rule; the caller enforces the context limit."""
        spec = self.spec
        step = self.num_tokens
        ctx = TokenModel.context(spec.context_key, step)
        may_stop = step >= spec.min_tokens
        token = self._choose(ctx, step, may_stop)
        self.num_tokens += 1
        info = self._logprobs(ctx, token) if spec.logprobs is not None else None

        is_eos = token == self.vocab.eos_token_id and not spec.ignore_eos
        if may_stop and (is_eos or token in spec.stop_token_ids):
            if spec.include_stop_strings and self._stream is not None:
                self._text += self._stream.step(token)
            stop = None if is_eos else token
            return Emitted(token, self._flush(final=True), info, Finish.STOP, stop, is_eos)

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
                return Emitted(token, self._flush(final=True), info, Finish.STOP, matched, False)
        return self._finish_if_full(token, self._flush(final=False), info)

    def finish_length(self) -> str:
        """End for length; returns the text still held back for stop-string matching."""
        return self._flush(final=True)

    def _choose(self, ctx: int, step: int, may_stop: bool) -> int:
        spec = self.spec
        eos = self.vocab.eos_token_id
        if spec.forced is not None:
            return spec.forced[step] if step < len(spec.forced) else eos
        if (
            may_stop
            and step
            and not spec.ignore_eos
            and spec.eos_probability > 0.0
            and ((ctx >> 11) & 0xFFFFF) / 0x100000 < spec.eos_probability
        ):
            return eos
        masked: frozenset[int] = _NOTHING
        if not may_stop:
            masked = spec.stop_token_ids if spec.ignore_eos else spec.stop_token_ids | {eos}
        if spec.processing.plain_greedy:
            return self.model.greedy(ctx, masked)
        if self._rng is None:
            self._rng = random.Random(spec.sample_seed + step.to_bytes(4, "little"))
        return self.model.sample(ctx, spec.processing, masked, self._rng)

    def _finish_if_full(self, token: int, text: str, info: TokenInfo | None) -> Emitted:
        if self.num_tokens >= self.spec.max_tokens:
            return Emitted(token, text + self._flush(final=True), info, Finish.LENGTH, None, False)
        return Emitted(token, text, info, Finish.NOT_FINISHED, None, False)

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

    def _logprobs(self, ctx: int, token: int) -> TokenInfo:
        spec = self.spec.logprobs
        assert spec is not None
        model = self.model
        rank = model.rank_of(ctx, token)
        logprob = model.raw_logprob(rank)
        if spec.token_ids:
            candidates = tuple(
                (t, model.raw_logprob(r), r)
                for t in spec.token_ids
                if t < model.vocab_size
                for r in (model.rank_of(ctx, t),)
            )
        else:
            candidates = tuple(
                (model.token_at(ctx, k), model.raw_logprob(k), k) for k in range(1, spec.top_n + 1)
            )
        return TokenInfo(token, logprob, rank, candidates)
