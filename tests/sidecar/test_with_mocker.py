"""The sidecar against the mock engine: slow start, pinning proven by the engine's counters,
the routing layer's ``load`` policy, engine death and restart, flapping, a restart with a
different model, overload, decode hand-off and 1,000 random disconnects without a leak."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from typing import Any

import pytest

from rankgate.mocker.config import MockEngineConfig
from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.errors import (
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
)
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.types import SamplingParams, StoppingParams
from tests.sidecar.fake_vllm import collect, request
from tests.sidecar.routers import FixedRouter
from tests.support.mock_engine import MockEngineHandle, running_mock_engine
from tests.support.polling import until
from tests.support.ports import free_port

BASE = MockEngineConfig(
    host="127.0.0.1", port=0, dp_size=2, block_size=16, model="mock-llm", speed=0.0
)


@contextmanager
def mock_engine(**overrides: Any) -> Iterator[MockEngineHandle]:
    config = replace(BASE, port=overrides.pop("port", None) or free_port(), **overrides)
    with running_mock_engine(config) as handle:
        yield handle


@asynccontextmanager
async def sidecar_on(
    handle: MockEngineHandle, router: Any = None, **config: Any
) -> AsyncIterator[Sidecar]:
    settings: dict[str, Any] = {
        "endpoint": handle.target,
        "startup_timeout": 20.0,
        "retry_interval": 0.05,
        "health_interval": 0.05,
    }
    settings.update(config)
    sidecar = Sidecar(SidecarConfig(**settings), router or FixedRouter())
    await sidecar.start()
    try:
        yield sidecar
    finally:
        await sidecar.close()


def leaks(handle: MockEngineHandle) -> dict[int, tuple[int, int]]:
    """(active, leaked) per rank once the engine is idle."""
    handle.wait_idle()
    return {rank: (s.active, s.leaked) for rank, s in handle.all_stats().items()}


async def test_slow_start_is_waited_for() -> None:
    with mock_engine(startup_delay_s=1.0) as handle:
        began = time.monotonic()
        async with sidecar_on(handle) as sidecar:
            assert time.monotonic() - began >= 0.9
            assert sidecar.ready
            assert sidecar.info.served_model_name == "mock-llm"
            assert sidecar.info.ranks == (0, 1)


@pytest.mark.parametrize("rank", [0, 1])
async def test_rank_pinning_is_proven_by_the_engine_counters(rank: int) -> None:
    with mock_engine() as handle:
        async with sidecar_on(handle, FixedRouter(rank=rank)) as sidecar:
            for i in range(5):
                await collect(sidecar.generate(request(f"p{i}")))
        stats = handle.all_stats()
        assert stats[rank].requests_received == 5
        assert stats[1 - rank].requests_received == 0


async def test_load_policy_from_the_routing_layer_spreads_concurrent_requests() -> None:
    with mock_engine(speed=1.0) as handle:
        router = build_router(RoutingConfig(policy="load"))
        async with sidecar_on(handle, router) as sidecar:
            streams = [
                sidecar.generate(request(f"l{i}", stopping=StoppingParams(max_tokens=20)))
                for i in range(8)
            ]
            results = await asyncio.gather(*(collect(s) for s in streams))
            assert all(r[-1].finish_reason in ("length", "stop") for r in results)
            assert sidecar.in_flight() == {0: 0, 1: 0}
        stats = handle.all_stats()
        assert stats[0].requests_received == 4
        assert stats[1].requests_received == 4


async def test_prompt_count_and_text_through_the_mocker() -> None:
    with mock_engine() as handle:
        async with sidecar_on(handle) as sidecar:
            deltas = await collect(
                sidecar.generate(
                    request(
                        "t",
                        n=2,
                        sampling=SamplingParams(temperature=1.0, seed=3),
                        stopping=StoppingParams(max_tokens=6, ignore_eos=True),
                    )
                )
            )
    for choice in (0, 1):
        mine = [d for d in deltas if d.index == choice]
        assert mine[0].prompt_tokens == 3
        assert mine[-1].finish_reason == "length"
        assert mine[-1].completion_tokens == 6
        assert sum(len(d.token_ids) for d in mine) == 6


async def test_engine_death_mid_stream_then_recovery() -> None:
    with mock_engine(speed=1.0) as handle:
        async with sidecar_on(handle, FixedRouter(rank=0)) as sidecar:
            handle.faults.kill_after_tokens(3)
            with pytest.raises((EngineFailure, EngineUnavailable)):
                await collect(
                    sidecar.generate(
                        request("dead", stopping=StoppingParams(max_tokens=50, ignore_eos=True))
                    )
                )
            await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
            with pytest.raises(EngineUnavailable) as caught:
                await collect(sidecar.generate(request("refused")))
            assert caught.value.retry_after >= 1.0
            assert sidecar.in_flight() == {0: 0, 1: 0}
            handle.faults.revive_engine()
            await until(lambda: sidecar.ready, 10, "the sidecar is ready again")
            deltas = await collect(sidecar.generate(request("alive")))
            assert deltas[-1].finish_reason is not None
        assert leaks(handle) == {0: (0, 0), 1: (0, 0)}


async def test_flapping_health_settles_ready() -> None:
    with mock_engine() as handle:
        async with sidecar_on(handle) as sidecar:
            assert sidecar.ready
            handle.faults.flap_health(0.3, 4)
            await until(lambda: not sidecar.ready, 10, "the flapping takes the sidecar down")
            await until(
                lambda: not handle.faults.flapping() and sidecar.ready,
                10,
                lambda: f"flapping: {handle.faults.flapping()}, ready: {sidecar.ready}",
            )


async def test_restart_with_a_different_model_is_refused_then_restored() -> None:
    port = free_port()
    with mock_engine(port=port) as handle:
        sidecar = Sidecar(
            SidecarConfig(endpoint=handle.target, retry_interval=0.05, health_interval=0.05),
            FixedRouter(),
        )
        await sidecar.start()
    try:
        await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
        with mock_engine(port=port, model="another-llm"):
            await until(
                lambda: "'mock-llm' -> 'another-llm'" in _problem(sidecar),
                10,
                lambda: f"the problem said is {_problem(sidecar)!r}",
            )
            assert not sidecar.ready
        with mock_engine(port=port):
            await until(lambda: sidecar.ready, 10, "the sidecar is ready again")
            assert len(await collect(sidecar.generate(request()))) >= 1
    finally:
        await sidecar.close()


async def test_restart_with_a_different_dp_size_is_refused() -> None:
    port = free_port()
    with mock_engine(port=port) as handle:
        sidecar = Sidecar(
            SidecarConfig(endpoint=handle.target, retry_interval=0.05, health_interval=0.05),
            FixedRouter(),
        )
        await sidecar.start()
    try:
        with mock_engine(port=port, dp_size=4):
            await until(
                lambda: "data_parallel_size: 2 -> 4" in _problem(sidecar),
                10,
                lambda: f"the problem said is {_problem(sidecar)!r}",
            )
            assert not sidecar.ready
    finally:
        await sidecar.close()


async def test_overload_is_a_429_type() -> None:
    with mock_engine() as handle:
        async with sidecar_on(handle) as sidecar:
            handle.faults.reject_requests(1, "too many requests")
            with pytest.raises(EngineOverloaded, match="too many requests"):
                await collect(sidecar.generate(request()))
            assert sidecar.ready


async def test_engine_validation_message_reaches_the_caller() -> None:
    with mock_engine() as handle:
        async with sidecar_on(handle) as sidecar:
            with pytest.raises(InvalidRequest):
                await collect(sidecar.generate(request(prompt_token_ids=(10**8,))))


async def test_cancelled_decode_handoff_strands_nothing() -> None:
    # Slow enough that the first token comes well after the client is gone.
    with mock_engine(speed=0.05) as handle:
        async with sidecar_on(handle, FixedRouter(rank=1)) as sidecar:
            decode = request(
                "dec",
                stopping=StoppingParams(max_tokens=50, ignore_eos=True),
                kv_transfer_params={"do_remote_prefill": True, "remote_port": 5600},
            )
            task = asyncio.ensure_future(collect(sidecar.generate(decode)))
            await until(
                lambda: handle.stats(1).active == 1,
                10,
                lambda: f"{handle.stats(1).active} active on rank 1",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(
                lambda: sidecar.in_flight() == {0: 0, 1: 0},
                20,
                lambda: f"in flight: {sidecar.in_flight()}",
            )
        # The engine learns of the cancel when the stream's reset reaches it, which on a busy
        # machine can come after the gateway has already let the request go.
        await until(
            lambda: handle.stats(1).aborts == 1,
            20,
            lambda: f"{handle.stats(1).aborts} aborts on rank 1",
        )
        stats = handle.stats(1)
        assert stats.stranded_transfers == 0
        assert stats.aborts == 1
        assert leaks(handle) == {0: (0, 0), 1: (0, 0)}


async def test_a_thousand_random_disconnects_leak_nothing() -> None:
    """Requests that would run for half a minute are abandoned at random points: closed after a
    few deltas, or their consumer cancelled (often before the first token). Only dropping the
    streams can leave the engine idle right after; a sample finishes normally beside them."""
    rng = random.Random(1234)
    with mock_engine(speed=1.0, max_model_len=8192) as handle:
        router = build_router(RoutingConfig(policy="round_robin"))
        async with sidecar_on(handle, router) as sidecar:

            async def one(i: int) -> str:
                mode = rng.random()
                finishing = mode >= 0.9
                stream = sidecar.generate(
                    request(
                        f"d{i}",
                        n=rng.choice((1, 1, 1, 2, 3)),
                        sampling=SamplingParams(temperature=1.0),
                        stopping=StoppingParams(
                            max_tokens=rng.randint(1, 20) if finishing else 4000,
                            ignore_eos=True,
                        ),
                    )
                )
                if finishing:
                    deltas = await collect(stream)
                    assert deltas[-1].finish_reason == "length"
                    return "completed"
                if mode < 0.45:
                    keep = rng.randint(0, 5)
                    async for _ in stream:
                        keep -= 1
                        if keep < 0:
                            break
                    await stream.aclose()
                    return "closed"
                task = asyncio.ensure_future(collect(stream))
                await asyncio.sleep(rng.random() * 0.02)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return "cancelled"

            outcomes: list[str] = []
            for start in range(0, 1000, 50):
                outcomes += await asyncio.gather(*(one(i) for i in range(start, start + 50)))
            assert outcomes.count("closed") > 350
            assert outcomes.count("cancelled") > 350
            assert outcomes.count("completed") > 50
            assert sidecar.in_flight() == {0: 0, 1: 0}
            assert sidecar.ready
            # Nothing may still be generating: the dropped streams were aborted at once.
            handle.wait_idle(timeout=2.0)
        stats = handle.all_stats()
        for rank_stats in stats.values():
            assert rank_stats.aborts > 300
            assert (
                rank_stats.requests_received
                == rank_stats.requests_served + rank_stats.aborts + rank_stats.failed
            )
        assert leaks(handle) == {0: (0, 0), 1: (0, 0)}


def _problem(sidecar: Sidecar) -> str:
    try:
        _ = sidecar.info
    except EngineUnavailable as error:
        return error.message
    return ""
