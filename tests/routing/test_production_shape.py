"""The kv policy under production-shaped traffic, on the clock-free rank simulation.

Skewed system prompts (Zipf 1.3 over 64: the most popular opens a third of the sessions),
open-loop Poisson sessions of growing multi-turn contexts, KV caches smaller than the working
set, DP 4 to 32; and agent loops, whose sessions' contexts grow to tens of thousands of
tokens of their own. Each property is also checked against vllm-router's ``kv_aware`` choice (the
longest cached prefix, load ignored), which breaks it: the tests can fail.
"""

from __future__ import annotations

import functools
import statistics

import pytest

from tests.support.rank_sim import EngineModel, Outcome, full_rate, simulate
from tests.support.sessions import AGENTS, Shape

SHARE_BOUND = 1.5
SECONDS = 40.0


@functools.cache
def _run(dp: int, policy: str, load: float, prompts: int = 64) -> Outcome:
    model = EngineModel(dp=dp)
    shape = Shape(prompts=prompts)
    return simulate(model, policy, shape, load, SECONDS, rate=full_rate(model, shape))


@pytest.mark.parametrize("dp", [4, 8, 16, 32])
def test_no_rank_takes_more_than_its_share_bound_under_skewed_traffic(dp: int) -> None:
    kv = _run(dp, "kv", 0.9)
    assert kv.work_share <= SHARE_BOUND
    assert kv.request_share <= SHARE_BOUND
    if dp >= 8:
        longest = _run(dp, "longest_prefix", 0.9)
        assert max(longest.work_share, longest.request_share) > SHARE_BOUND


@pytest.mark.parametrize("dp", [4, 8, 16, 32])
def test_spreading_keeps_the_cache_hits_and_the_first_token_times(dp: int) -> None:
    kv = _run(dp, "kv", 0.9)
    longest = _run(dp, "longest_prefix", 0.9)
    round_robin = _run(dp, "round_robin", 0.9)
    # Each extra copy of a hot prefix costs one cold prefill: the hit rate stays within a few
    # points of piling every request onto the first copy, far above blind spreading.
    assert kv.hit_rate >= longest.hit_rate - 0.03
    assert kv.hit_rate >= round_robin.hit_rate + 0.1
    assert kv.mean_ttft < 0.7 * round_robin.mean_ttft
    assert statistics.fmean(kv.latencies) <= 1.02 * statistics.fmean(longest.latencies)
    assert kv.mean_ttft <= 1.1 * longest.mean_ttft
    if dp >= 32:
        # Wide, the few ranks piled onto queue: spreading answers sooner.
        assert kv.mean_ttft <= 0.9 * longest.mean_ttft


@pytest.mark.parametrize("dp", [4, 8])
def test_a_prefix_every_session_shares_spreads_before_its_rank_saturates(dp: int) -> None:
    kv = _run(dp, "kv", 1.0, prompts=1)
    longest = _run(dp, "longest_prefix", 1.0, prompts=1)
    # Longest-prefix routing keeps one rank stepping nearly all the time and the rest idle.
    assert max(longest.busy) > 0.9
    assert sum(1 for busy in longest.busy if busy > 0) == 1
    # The kv policy opened more copies while the first rank still had time to spare.
    assert max(kv.busy) < 0.9
    assert sum(1 for busy in kv.busy if busy > 0.2) >= dp // 2
    assert kv.request_share <= SHARE_BOUND
    assert max(kv.deepest_queue) <= max(longest.deepest_queue)


@pytest.mark.parametrize("policy", ["kv", "longest_prefix", "round_robin"])
def test_no_request_beats_its_floor_and_its_recomputed_prefill(policy: str) -> None:
    """The floor bounds every router: each request's first token comes no sooner than its
    rank could prefill the blocks no earlier request carried, plus those it had to prefill
    again, alone on an idle rank."""
    outcome = _run(4, policy, 0.9)
    assert len(outcome.floors) == len(outcome.ttfts) == len(outcome.recomputed) > 100
    for ttft, floor, recomputed, elsewhere in zip(
        outcome.ttfts,
        outcome.floors,
        outcome.recomputed,
        outcome.recomputed_elsewhere,
        strict=True,
    ):
        assert ttft >= floor + recomputed - 1e-9
        assert 0 <= elsewhere <= recomputed + 1e-12
    # Blind spreading recomputes what another rank holds; the KV-aware choice rarely does.
    blind, aware = _run(4, "round_robin", 0.9), _run(4, "kv", 0.9)
    assert sum(blind.recomputed) > 5 * sum(aware.recomputed)
    assert sum(blind.recomputed_elsewhere) > 10 * sum(aware.recomputed_elsewhere)


def test_agent_sessions_keep_their_histories_and_their_share() -> None:
    """Agent loops at DP 8: each session's growing history is cached where its last turn ran,
    and 16 agent definitions, one of them hot, open sessions on every rank."""
    model = EngineModel(dp=8, kv_blocks=16384)
    rate = full_rate(model, AGENTS, 1200.0, offered=True)
    kv = simulate(model, "kv", AGENTS, 0.7, 240.0, rate=rate)
    longest = simulate(model, "longest_prefix", AGENTS, 0.7, 240.0, rate=rate)
    assert len(kv.ttfts) > 1000
    # Turns find their history: next to nothing computed again of what an earlier turn left.
    assert sum(kv.recomputed) < 0.02 * sum(kv.ttfts)
    assert kv.hit_rate >= longest.hit_rate
    assert kv.work_share <= SHARE_BOUND
    assert kv.request_share <= SHARE_BOUND
    # The longest-prefix rule sends every new session of the hot agent to the rank holding its
    # prompt, whose queue then grows through the run.
    assert longest.work_share > 2 * SHARE_BOUND
    assert kv.mean_ttft < 0.5 * longest.mean_ttft
    assert kv.quantile(0.99) < 0.5 * longest.quantile(0.99)
