"""Each rank's speed, learned from its first tokens, and what the router does with it.

The estimator is fed what the gateway sees (time to first token against the prefill queued
ahead plus the request's own); the decisions are checked on the clock-free rank simulation,
where a rank runs at a chosen fraction of the others' speed and sessions arrive in waves.
"""

from __future__ import annotations

import functools
import random

from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.load import RankPace
from rankgate.sidecar.routing.metrics import routing_metrics
from rankgate.sidecar.routing.policies import KvRouter
from tests.routing.conftest import engine_info, prepared, sample
from tests.support.rank_bounds import CONDITIONS, setting
from tests.support.rank_sim import EngineModel, Outcome, run_plan, simulate
from tests.support.sessions import Bursts, Shape

SLOW = 0.4


def _feed(pace: RankPace, speeds: list[float], samples: int, seed: int = 1) -> None:
    """Samples of varied work on each rank, each taking its time at the rank's speed, noisy."""
    rng = random.Random(seed)
    for _ in range(samples):
        for slot, speed in enumerate(speeds):
            work = rng.randint(100, 3000)
            seconds = (work + 256) / (20_000 * speed) * rng.uniform(0.85, 1.15)
            pace.observe(slot, work, seconds)


def test_alike_ranks_stay_alike_through_noise() -> None:
    pace = RankPace(8)
    _feed(pace, [1.0] * 8, 200)
    assert pace.speeds() == [1.0] * 8
    assert not pace.uneven


def test_a_slow_rank_is_learned_at_its_speed() -> None:
    pace = RankPace(8)
    _feed(pace, [SLOW] + [1.0] * 7, 200)
    speeds = pace.speeds()
    assert abs(speeds[0] - SLOW) < 0.05
    assert speeds[1:] == [1.0] * 7
    assert pace.uneven
    # It recovers: within a few dozen samples at full speed it counts as alike again.
    _feed(pace, [1.0] * 8, 100, seed=2)
    assert pace.speeds() == [1.0] * 8


async def test_the_route_says_what_it_saw_of_a_slow_rank() -> None:
    now = [0.0]
    registry = CollectorRegistry()
    router = KvRouter(RoutingConfig(), routing_metrics(registry), lambda: now[0])
    router.configure(engine_info((0, 1)))
    pace = router.load.pace
    assert pace is not None
    _feed(pace, [SLOW, 1.0], 100)
    prompt = list(range(1000, 1400))
    first = router.route(prepared([*prompt, 1], "a"))
    # The same prompt costs the slow rank two and a half times as long: the fast one takes it.
    assert first.decision.rank == 1
    ticket = router.route(prepared([*prompt, 2], "b"))
    assert ticket.decision.rank == 1
    # Queued behind the first, at rank 1's learned pace.
    assert ";wait_ms=" in ticket.decision.header()
    assert ";speed=" not in ticket.decision.header()
    pinned = router.route(prepared(list(range(5000, 5400)), "c", rank=0))
    assert ";speed=0.4" in pinned.decision.header()
    assert sample(registry, "rankgate_routing_rank_speed", rank="0") < 0.5
    assert sample(registry, "rankgate_routing_rank_speed", rank="1") == 1.0
    assert sample(registry, "rankgate_routing_predicted_wait_seconds", rank="1") > 0.0


@functools.cache
def _slow(dp: int, policy: str, pace: bool = True) -> Outcome:
    found = setting(CONDITIONS["slow"], dp, Shape(), 0.65)
    config = RoutingConfig() if pace else RoutingConfig(pace_keep=0.0)
    return run_plan(found.model, policy, found.shape, found.rate, 40.0, config)


def test_a_slow_rank_gets_less_work_in_proportion_to_its_speed() -> None:
    kv = _slow(8, "kv")
    requests = [kv.slots.count(slot) for slot in range(8)]
    fast = sum(requests[1:]) / 7
    # A rank at 0.4x takes near 0.4x of a fast rank's requests (learning its speed takes a
    # few seconds of its first tokens), not its even share.
    assert requests[0] <= 1.6 * SLOW * fast
    assert kv.work_share <= 1.5
    assert kv.request_share <= 1.5
    # Without the learned speed it took its even share and more, and first tokens came later.
    blind = _slow(8, "kv", pace=False)
    assert blind.slots.count(0) > 1.8 * requests[0]
    assert kv.mean_ttft < 0.95 * blind.mean_ttft


def test_a_burst_spreads_a_hot_prefix_before_its_rank_queue_exceeds_a_bound() -> None:
    """One system prompt every session shares, arriving in waves at 2.5x the mean rate: the
    kv policy opens copies while the first rank's queue is short; the longest-prefix rule
    piles every wave onto the rank holding it. (The spreading's cold prefills cost the kv
    policy at the 99th percentile here: 225 ms against 180.)"""
    model = EngineModel(dp=8)
    shape = Shape(prompts=1, bursts=Bursts())
    kv = simulate(model, "kv", shape, 0.7, 40.0)
    longest = simulate(model, "longest_prefix", shape, 0.7, 40.0)
    # Requests waiting or running on any one rank: the longest-prefix rule had 42 on one.
    bound = 12
    assert max(kv.most_in_flight) <= bound < max(longest.most_in_flight)
    assert sum(1 for busy in kv.busy if busy > 0.2) >= 4
    assert kv.mean_ttft < longest.mean_ttft
