"""The ``kv`` router against real vLLM (DP=2): requests sharing a long prefix land on the rank
whose KV events announced it, and the router's predictions come true by vLLM's own events.

The prefix is first computed on rank 1 by pinning (vLLM's own balancer would have used rank 0),
and the router runs without bridging predictions, so only rank 1's real KV events, decoded and
re-hashed by the router, can draw the later requests there.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import KvRouter, build_router
from rankgate.sidecar.types import PreparedRequest, SamplingParams, StoppingParams
from tests.conformance.helpers import fresh_prompt
from tests.support.engines import EngineUnderTest
from tests.support.polling import until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

PREFIX_BLOCKS = 8


def _request(tokens: list[int], request_id: str, rank: int | None = None) -> PreparedRequest:
    return PreparedRequest(
        request_id=request_id,
        prompt_token_ids=tuple(tokens),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=2),
        rank=rank,
    )


async def _complete(sidecar: Sidecar, request: PreparedRequest) -> None:
    async for _ in sidecar.generate(request):
        pass


async def test_shared_prefix_follows_the_announcing_rank(real_vllm: EngineUnderTest) -> None:
    registry = CollectorRegistry()
    # The KV events alone: no predictions, and no share term (the dry runs below would tip it).
    # Every request measured: each follower comes right after its dry run on the same rank.
    config = RoutingConfig(pending_ttl=0, share_weight=0, regret_interval=0)
    router = build_router(config, registry)
    assert isinstance(router, KvRouter)
    sidecar = Sidecar(
        SidecarConfig(endpoint=real_vllm.target, startup_timeout=120.0, health_interval=2.0),
        router,
    )
    await sidecar.start()
    try:
        block = real_vllm.block_size
        prefix = fresh_prompt(PREFIX_BLOCKS * block)
        tails = [fresh_prompt(block // 2) for _ in range(4)]
        keys = router.chain(_request(prefix, "probe")).finish()
        assert len(keys) == PREFIX_BLOCKS

        await _complete(sidecar, _request(prefix + tails[0], "warm", rank=1))
        await until(
            lambda: (
                router.view.events is not None
                and router.view.events.match(keys).device[1] >= PREFIX_BLOCKS
            ),
            60.0,
            "rank 1 announces the prefix",
        )
        assert router.view.events is not None

        before = registry.get_sample_value(
            "rankgate_routing_requests_total", {"policy": "kv", "rank": "1"}
        )
        for index, tail in enumerate(tails[1:]):
            # A dry run shows the decision; the real request then goes through the sidecar.
            ticket = router.route(_request(prefix + tail, f"look{index}"))
            ticket.finished()
            assert ticket.decision.rank == 1
            assert ticket.decision.cached_tokens == PREFIX_BLOCKS * block
            await _complete(sidecar, _request(prefix + tail, f"follow{index}"))
        after = registry.get_sample_value(
            "rankgate_routing_requests_total", {"policy": "kv", "rank": "1"}
        )
        assert before is not None
        assert after is not None
        assert after - before == 2 * len(tails[1:])
        # Rank 0 never computed the prefix: nothing was sent there.
        assert router.view.events.match(keys).device[0] == 0
        cached = registry.get_sample_value("rankgate_routing_cached_tokens_total", {"rank": "1"})
        assert cached is not None
        assert cached >= 2 * len(tails[1:]) * PREFIX_BLOCKS * block

        # Every prediction came true by rank 1's own events: the warm-up computed the prefix,
        # the followers hit it whole.
        def rank1(name: str) -> float:
            value = registry.get_sample_value(name, {"policy": "kv", "rank": "1"})
            return value or 0.0

        regret = router.regret
        assert regret is not None

        def measured() -> bool:
            regret.settle()
            return rank1("rankgate_routing_measured_requests_total") >= len(tails)

        await until(measured, 60.0, "the followers' predictions checked")
        predicted = rank1("rankgate_routing_predicted_hit_tokens_total")
        assert predicted == len(tails[1:]) * PREFIX_BLOCKS * block
        assert rank1("rankgate_routing_realised_hit_tokens_total") == predicted
        assert regret.trusted(1)
    finally:
        await sidecar.close()
