"""Production-shaped conversations: skewed system prompts, open-loop arrivals, growing turns.

One definition for the live benchmark on the mock engine (``bench/production_routing.py``)
and the clock-free simulation the routing property tests run (:mod:`tests.support.rank_sim`):

- sessions arrive as a Poisson process; each opens with one of ``prompts`` long system
  prompts, drawn with Zipf skew ``zipf`` (1.3 over 64 prompts gives the most popular about a
  third of the sessions), then a user message of its own;
- a session runs a geometric number of turns (mean ``turns``), as agents do: every turn waits
  for the previous answer and a pause, then resends the whole history plus a new message.

:data:`AGENTS` is the agent-shaped variant: a few long tool-laden system prompts, a dozen turns
on average, each adding a tool result of up to 4k tokens, so one session's context grows from
2k-8k tokens to tens of thousands and is its own, shared with no other session.

:class:`Bursts` makes the arrivals come in waves (a campaign, a batch job, a time zone waking):
the Poisson rate steps between a high and a low factor of its mean, so queues build during a
wave and drain after it, and a router has to spread a hot prefix while a wave builds.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
from collections.abc import Sequence

VOCAB = (100, 3000)


@dataclasses.dataclass(frozen=True)
class Bursts:
    """On/off arrivals: ``on_seconds`` at ``on_factor`` times the mean rate, then
    ``off_seconds`` at ``off_factor``, repeated. The defaults average the mean rate."""

    on_seconds: float = 3.5
    on_factor: float = 2.5
    off_seconds: float = 6.5
    off_factor: float = 0.19

    def factor(self, at: float) -> float:
        """The rate's multiple at ``at`` seconds into the run."""
        phase = at % (self.on_seconds + self.off_seconds)
        return self.on_factor if phase < self.on_seconds else self.off_factor


@dataclasses.dataclass(frozen=True)
class Shape:
    prompts: int = 64
    zipf: float = 1.3
    system_tokens: tuple[int, int] = (1024, 3072)
    user_tokens: tuple[int, int] = (64, 256)
    output_tokens: tuple[int, int] = (16, 48)
    turns: float = 3.0
    think_seconds: float = 0.5
    seed: int = 1
    # Sessions arrive in waves of this shape (None: a steady Poisson process).
    bursts: Bursts | None = None


# Agent loops: 16 agent definitions (tools and instructions), tool results as the new
# "user" message each turn, tool calls and short answers as output, a second of tool time.
AGENTS = Shape(
    prompts=16,
    zipf=1.1,
    system_tokens=(2048, 8192),
    user_tokens=(256, 4096),
    output_tokens=(32, 256),
    turns=12.0,
    think_seconds=1.0,
)


@dataclasses.dataclass(frozen=True)
class Session:
    start: float
    system: int
    # Per turn: the new user message and the stand-in for the model's previous answer.
    messages: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[int, ...], ...]
    pauses: tuple[float, ...]
    outputs: tuple[int, ...]

    def prompt(self, systems: Sequence[tuple[int, ...]], turn: int) -> tuple[int, ...]:
        """Turn ``turn``'s prompt: the system prompt, then every earlier message and answer,
        then this turn's message."""
        history: list[int] = list(systems[self.system])
        for earlier in range(turn):
            history += self.messages[earlier]
            history += self.answers[earlier]
        history += self.messages[turn]
        return tuple(history)


_VOCAB_IDS = range(*VOCAB)


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.choices(_VOCAB_IDS, k=count))


def system_prompts(shape: Shape) -> list[tuple[int, ...]]:
    rng = random.Random(shape.seed)
    return [_tokens(rng, rng.randint(*shape.system_tokens)) for _ in range(shape.prompts)]


def zipf_table(shape: Shape) -> list[float]:
    weights = [1.0 / (i + 1) ** shape.zipf for i in range(shape.prompts)]
    total = sum(weights)
    return list(itertools.accumulate(w / total for w in weights))


def one_session(
    shape: Shape, rng: random.Random, cumulative: Sequence[float], at: float
) -> Session:
    turns = 1
    while rng.random() > 1.0 / shape.turns:
        turns += 1
    return Session(
        start=at,
        system=min(bisect.bisect_left(cumulative, rng.random()), shape.prompts - 1),
        messages=tuple(_tokens(rng, rng.randint(*shape.user_tokens)) for _ in range(turns)),
        answers=tuple(_tokens(rng, rng.randint(*shape.output_tokens)) for _ in range(turns)),
        pauses=tuple(rng.expovariate(1.0 / shape.think_seconds) for _ in range(turns)),
        outputs=tuple(rng.randint(*shape.output_tokens) for _ in range(turns)),
    )


def sessions(shape: Shape, rate: float, seconds: float, seed: int) -> list[Session]:
    """The sessions starting in ``seconds`` at ``rate`` a second; the same for every target."""
    rng = random.Random(seed)
    cumulative = zipf_table(shape)
    out: list[Session] = []
    bursts = shape.bursts
    if bursts is None:
        at = rng.expovariate(rate)
        while at < seconds:
            out.append(one_session(shape, rng, cumulative, at))
            at += rng.expovariate(rate)
        return out
    # Waves by thinning: candidates at the highest rate, each kept at its moment's share.
    most = max(bursts.on_factor, bursts.off_factor)
    at = rng.expovariate(rate * most)
    while at < seconds:
        if rng.random() * most < bursts.factor(at):
            out.append(one_session(shape, rng, cumulative, at))
        at += rng.expovariate(rate * most)
    return out
