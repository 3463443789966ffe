"""End to end through the gateway's HTTP API against the mock engine (DP=4, GPU-like timing).

Each policy gets its own fresh engine and gateway; the policies run side by side so that
whatever else loads the machine slows them alike. Hit rates are the engine's own counts of
cached prompt tokens; TTFT is measured at the HTTP client (first streamed chunk).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.routing.workload import NoReuse, PolicyResult, SharedPrefix, run_policy, table

pytestmark = pytest.mark.timeout(180)

# The GPU-like model slowed tenfold (a larger model): simulated prefill and decode time, not
# the CPU of this machine, then dominates every TTFT.
SPEED = 0.1


async def test_kv_beats_every_baseline_on_shared_prefix_conversations_via_gateway() -> None:
    work = SharedPrefix()
    results: list[PolicyResult] = await asyncio.gather(
        *(
            run_policy(policy, work, SPEED, via="gateway")
            for policy in ("kv", "load", "round_robin", "engine")
        )
    )
    print("\n" + table(results))
    kv, *baselines = results
    assert kv.requests == work.conversations * work.turns
    for other in baselines:
        assert kv.hit_rate >= other.hit_rate + 0.12, other.policy
        assert kv.mean_ttft <= 0.9 * other.mean_ttft, other.policy


# One side-by-side run on a shared 2-core machine scatters mean TTFT by several percent even
# when both policies spread the requests identically; a real regression fails every attempt.
NO_REUSE_ATTEMPTS = 3


async def test_kv_costs_nothing_without_reuse() -> None:
    work = NoReuse()
    ratios = []
    for _ in range(NO_REUSE_ATTEMPTS):
        kv, load = await asyncio.gather(
            run_policy("kv", work, SPEED, via="gateway"),
            run_policy("load", work, SPEED, via="gateway"),
        )
        print("\n" + table([kv, load]))
        assert kv.requests == load.requests == work.requests
        assert kv.hit_rate == load.hit_rate == 0.0
        ratios.append(kv.mean_ttft / load.mean_ttft)
        if ratios[-1] <= 1.05:
            return
    pytest.fail(f"kv's mean TTFT exceeded 1.05x load's in every attempt: {ratios}")
