"""The mock's language model: a deterministic distribution over the whole vocabulary.

For every context (prompt, LoRA and output position) the model ranks all token ids by a fixed,
context-dependent permutation, with word-like tokens first, and gives rank ``r`` the raw
logit ``-C * ln r`` (a near-uniform tail, like a small random model). Sampling then follows
vLLM's order: logit bias and masks, temperature, top-k, top-p, min-p. Reported logprobs and
ranks come from the raw distribution, as vLLM's default ``raw_logprobs`` mode reports them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

_MASK64 = (1 << 64) - 1
_STRIDES = (7919, 104729, 1299709, 15485863, 179424673)
_EXPLICIT_RANKS = 64
SLOPE = 0.35


def _stride_for(n: int) -> int:
    for candidate in _STRIDES:
        if n > 1 and math.gcd(candidate, n) == 1:
            return candidate % n or 1
    return 1


@dataclass(frozen=True, slots=True)
class Processing:
    """Everything that reshapes the raw distribution before a token is drawn."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    logit_bias: Mapping[int, float]
    allowed: frozenset[int] | None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing reshaping the distribution: the top raw rank always wins."""
        return (
            (self.temperature <= 0.0 or self.top_k == 1)
            and not self.logit_bias
            and self.allowed is None
        )


class TokenModel:
    """Ranks, logprobs and sampling for one vocabulary; built once per server."""

    def __init__(self, preferred: tuple[int, ...], vocab_size: int) -> None:
        preferred_set = set(preferred)
        rest = tuple(i for i in range(vocab_size) if i not in preferred_set)
        self._groups = (preferred, rest) if preferred else (rest, ())
        self._strides = tuple(_stride_for(len(g)) for g in self._groups)
        self._inverse = tuple(
            pow(s, -1, len(g)) if len(g) > 1 else 1
            for s, g in zip(self._strides, self._groups, strict=True)
        )
        self._position: dict[int, tuple[int, int]] = {}
        for group_index, group in enumerate(self._groups):
            for index, token in enumerate(group):
                self._position[token] = (group_index, index)
        self.vocab_size = vocab_size
        self._log_z = math.log(sum(r**-SLOPE for r in range(1, vocab_size + 1)))

    @staticmethod
    def context(key: int, step: int) -> int:
        return ((key ^ (step * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9) & _MASK64

    def token_at(self, ctx: int, rank: int) -> int:
        first = self._groups[0]
        if rank <= len(first):
            return first[(ctx + (rank - 1) * self._strides[0]) % len(first)]
        rest = self._groups[1]
        return rest[(ctx + (rank - 1 - len(first)) * self._strides[1]) % len(rest)]

    def rank_of(self, ctx: int, token: int) -> int:
        group_index, index = self._position[token]
        group = self._groups[group_index]
        offset = ((index - ctx) * self._inverse[group_index]) % len(group)
        return offset + 1 + (len(self._groups[0]) if group_index else 0)

    def raw_logprob(self, rank: int) -> float:
        return -SLOPE * math.log(rank) - self._log_z

    def greedy(self, ctx: int, masked: frozenset[int]) -> int:
        """The most likely token that is not masked (the hot path of greedy decoding)."""
        rank = 1
        token = self.token_at(ctx, 1)
        while token in masked and rank < self.vocab_size:
            rank += 1
            token = self.token_at(ctx, rank)
        return token

    def sample(
        self, ctx: int, processing: Processing, masked: frozenset[int], rng: random.Random
    ) -> int:
        """Draw one token; greedy when temperature is 0 or the filters leave one choice."""
        candidates = self._candidates(ctx, processing, masked)
        if not candidates:
            return self.token_at(ctx, 1)
        candidates.sort(key=lambda item: item[1], reverse=True)
        temperature = processing.temperature
        if temperature <= 0.0 or processing.top_k == 1 or len(candidates) == 1:
            return candidates[0][0]
        if processing.top_k > 0:
            candidates = candidates[: processing.top_k]
        top = candidates[0][1]
        weights = [math.exp((logit - top) / temperature) for _, logit in candidates]
        total = sum(weights)
        if processing.min_p > 0.0:
            floor = processing.min_p * weights[0]
            kept = [i for i, w in enumerate(weights) if w >= floor]
            candidates = [candidates[i] for i in kept]
            weights = [weights[i] for i in kept]
            total = sum(weights)
        if 0.0 < processing.top_p < 1.0:
            cumulative = 0.0
            for index, weight in enumerate(weights):
                cumulative += weight / total
                if cumulative >= processing.top_p:
                    candidates, weights = candidates[: index + 1], weights[: index + 1]
                    break
            total = sum(weights)
        draw = rng.random() * total
        for (token, _), weight in zip(candidates, weights, strict=True):
            draw -= weight
            if draw <= 0.0:
                return token
        return candidates[-1][0]

    def _candidates(
        self, ctx: int, processing: Processing, masked: frozenset[int]
    ) -> list[tuple[int, float]]:
        bias = processing.logit_bias
        if processing.allowed is not None:
            return [
                (t, self._logit(ctx, t) + bias.get(t, 0.0))
                for t in processing.allowed
                if t not in masked and t < self.vocab_size
            ]
        explicit = 1 if processing.temperature <= 0.0 else _EXPLICIT_RANKS
        found: list[tuple[int, float]] = []
        rank = 1
        while len(found) < explicit and rank <= self.vocab_size:
            token = self.token_at(ctx, rank)
            if token not in masked and token not in bias:
                found.append((token, -SLOPE * math.log(rank)))
            rank += 1
        for token, value in bias.items():
            if token not in masked and token < self.vocab_size:
                found.append((token, self._logit(ctx, token) + value))
        return found

    def _logit(self, ctx: int, token: int) -> float:
        return -SLOPE * math.log(self.rank_of(ctx, token))
