"""Routers wired to real ZMQ publishers on loopback, and a clock-free way to wait for them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.base import Router
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.routing.shared_load import SharedLoadBoard
from rankgate.sidecar.types import (
    EngineInfo,
    KvEventSource,
    PreparedRequest,
    RankCapacity,
    SamplingParams,
    StoppingParams,
)
from tests.routing.publisher import TestPublisher
from tests.support.polling import until

BLOCK = 4
# The rigs' routers weigh one thing at a time; the share term has tests of its own.
UNSHARED = RoutingConfig(share_weight=0)


def engine_info(
    ranks: Sequence[int] = (0, 1),
    *,
    block_size: int = BLOCK,
    kv_blocks: int = 1000,
    max_running: int = 64,
    sources: Sequence[KvEventSource] = (),
) -> EngineInfo:
    return EngineInfo(
        model_id="m",
        served_model_name="m",
        aliases=(),
        engine_version="0.32.0",
        instance_id="i",
        max_model_len=4096,
        block_size=block_size,
        dp_size=len(ranks),
        ranks=tuple(ranks),
        capacity=tuple(RankCapacity(rank, kv_blocks, max_running) for rank in ranks),
        max_batched_tokens=8192,
        supports_text_input=True,
        supports_lora=True,
        supports_multimodal=True,
        reasoning_parser="",
        tool_call_parser="",
        kv_event_sources=tuple(sources),
    )


def prepared(tokens: Sequence[int], request_id: str = "r", **fields: Any) -> PreparedRequest:
    return PreparedRequest(
        request_id=request_id,
        prompt_token_ids=tuple(tokens),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=8),
        **fields,
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


class EventRig:
    """A started ``kv`` router subscribed to one test publisher per rank.

    ``router`` is what the test routes with. Run ``shared``, it is the second of two workers,
    which reads the first one's index from shared memory, and ``intake_router`` is that first
    worker: every case about events then holds for a worker that receives none itself."""

    def __init__(
        self,
        router: Router,
        publishers: list[TestPublisher],
        registry: CollectorRegistry,
        intake_router: Router | None = None,
    ) -> None:
        self.router = router
        self.intake_router = intake_router or router
        self.publishers = publishers
        self.registry = registry

    def applied(self, rank: int) -> float:
        return sum(
            sample(self.registry, "rankgate_kv_event_batches_total", rank=str(rank), origin=o)
            for o in ("live", "replay")
        )

    async def settle(self, rank: int, batches: float) -> None:
        await until(
            lambda: self.applied(rank) >= batches,
            5,
            lambda: f"{self.applied(rank)} batches applied on rank {rank}",
        )

    def route(self, tokens: Sequence[int], **fields: Any) -> tuple[int | None, int]:
        """Route and finish at once, so load never skews the prefix decision under test."""
        ticket = self.router.route(prepared(tokens, **fields))
        ticket.finished()
        return ticket.decision.rank, ticket.decision.cached_tokens


RigFactory = Callable[..., Any]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest_asyncio.fixture(params=["alone", "shared"])
async def event_rig(
    request: pytest.FixtureRequest, registry: CollectorRegistry
) -> AsyncIterator[RigFactory]:
    made: list[tuple[Router, list[TestPublisher]]] = []
    boards: list[SharedLoadBoard] = []

    async def make(
        ranks: Sequence[int] = (0, 1),
        *,
        replay: bool = True,
        config: RoutingConfig | None = None,
        kv_blocks: int = 1000,
        max_running: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> EventRig:
        publishers = [TestPublisher(rank, replay=replay) for rank in ranks]
        sources = [
            KvEventSource(p.rank, p.endpoint, p.replay_endpoint, p.topic) for p in publishers
        ]
        info = engine_info(ranks, sources=sources, kv_blocks=kv_blocks, max_running=max_running)
        intake_router = None
        if request.param == "shared":
            first = SharedLoadBoard.create(2)
            second = SharedLoadBoard.attach(first.name, 2, 1)
            boards[:0] = [second, first]
            intake_router = build_router(config or UNSHARED, registry, first, clock)
            made.append((intake_router, []))
            intake_router.configure(info)
            await intake_router.start()
        router = build_router(config or UNSHARED, registry, boards[0] if boards else None, clock)
        made.append((router, publishers))
        router.configure(info)
        await router.start()
        for publisher in publishers:
            await asyncio.to_thread(publisher.wait_subscribed)
        return EventRig(router, publishers, registry, intake_router)

    yield make
    for router, publishers in made:
        await router.close()
        for publisher in publishers:
            publisher.close()
    for board in boards:
        board.close()
