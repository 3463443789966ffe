"""Startup: health gating, fail-fast, deadline, discovery validation, KV-event sources."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.errors import DiscoveryError, EngineUnavailable
from rankgate.sidecar.health import wait_for_serving
from rankgate.sidecar.types import KvEventSource, RankCapacity
from rankgate.wire.proto.vllm import control_pb2
from tests.sidecar.conftest import StartSidecar
from tests.sidecar.fake_vllm import (
    NOT_SERVING,
    SERVING,
    FakeServer,
    FakeVllm,
    model_info,
    server_info,
)
from tests.sidecar.routers import FixedRouter
from tests.support.polling import until
from tests.support.ports import free_port


def zmq_source(rank: int, port: int) -> control_pb2.KvEventSource:
    return control_pb2.KvEventSource(
        transport="zmq",
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{port + 100}",
        topic="kv-events",
        data_parallel_rank=rank,
    )


async def test_start_discovers_configures_and_starts_the_router(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    router = FixedRouter()
    sidecar = await start_sidecar(router)
    assert sidecar.ready
    info = sidecar.info
    assert info.served_model_name == "fake"
    assert info.ranks == (0, 1)
    assert info.capacity == (RankCapacity(0, 100, 8), RankCapacity(1, 100, 8))
    assert router.configured == [info]
    assert router.started
    assert sidecar.in_flight() == {0: 0, 1: 0}


async def test_not_started_sidecar_is_not_ready(fake: FakeServer) -> None:
    sidecar = Sidecar(SidecarConfig(endpoint=fake.target), FixedRouter())
    assert not sidecar.ready
    with pytest.raises(EngineUnavailable, match="not been discovered"):
        _ = sidecar.info


async def test_start_waits_for_control_then_inference(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.health["vllm.Control"] = NOT_SERVING
    fake.fake.health["vllm.Inference"] = NOT_SERVING
    starting = asyncio.ensure_future(start_sidecar())

    async def asked_again() -> None:
        """Until the sidecar has checked health twice more, each time finding it not ready."""
        asked = fake.fake.health_checks
        await until(
            lambda: fake.fake.health_checks >= asked + 2,
            10,
            lambda: f"{fake.fake.health_checks} health checks",
        )

    await asked_again()
    assert not starting.done()
    fake.fake.health["vllm.Control"] = SERVING
    await asked_again()
    assert not starting.done()
    checks_before = fake.fake.health_checks
    fake.fake.health["vllm.Inference"] = SERVING
    sidecar = await asyncio.wait_for(starting, 5)
    assert sidecar.ready
    assert fake.fake.health_checks > checks_before


async def test_start_waits_for_a_server_that_is_not_listening_yet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    server = FakeServer(FakeVllm())
    sidecar = Sidecar(
        SidecarConfig(endpoint=f"127.0.0.1:{port}", retry_interval=0.05, startup_timeout=10),
        FixedRouter(),
    )
    caplog.set_level(logging.DEBUG, logger="rankgate.sidecar.health")
    starting = asyncio.ensure_future(sidecar.start())

    def refused() -> list[str]:
        return [r.getMessage() for r in caplog.records if "waiting for vLLM" in r.getMessage()]

    await until(lambda: len(refused()) >= 3, 10, lambda: f"retries logged: {refused()}")
    assert not starting.done()
    await server.start(port)
    try:
        await asyncio.wait_for(starting, 8)
        assert sidecar.ready
    finally:
        await sidecar.close()
        await server.stop()


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED])
async def test_health_not_found_or_unimplemented_fails_fast(
    fake: FakeServer, start_sidecar: StartSidecar, code: grpc.StatusCode
) -> None:
    fake.fake.health["vllm.Control"] = code
    began = time.monotonic()
    with pytest.raises(DiscoveryError, match=f"answered {code.name}.*not a vLLM gRPC server"):
        await start_sidecar(startup_timeout=30)
    assert time.monotonic() - began < 5


async def test_startup_deadline(fake: FakeServer, start_sidecar: StartSidecar) -> None:
    fake.fake.health["vllm.Inference"] = NOT_SERVING
    began = time.monotonic()
    expected = r"startup deadline.*vllm\.Inference is NOT_SERVING"
    with pytest.raises(EngineUnavailable, match=expected):
        await start_sidecar(startup_timeout=1.5)
    assert 1.4 < time.monotonic() - began < 5


class _AnswersThenStalls:
    """A health stub: NOT_SERVING once, then every probe runs out of time."""

    def __init__(self) -> None:
        self.calls = 0

    async def Check(self, request: Any, timeout: float) -> Any:  # noqa: ASYNC109 (gRPC stub signature)
        self.calls += 1
        if self.calls == 1:
            return health_pb2.HealthCheckResponse(status=NOT_SERVING)
        await asyncio.sleep(timeout)
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "Deadline Exceeded",
        )


async def test_startup_deadline_names_the_engines_answer_over_a_late_timeout() -> None:
    health = _AnswersThenStalls()
    deadline = asyncio.get_running_loop().time() + 0.3
    with pytest.raises(EngineUnavailable, match=r"vllm\.Control is NOT_SERVING"):
        await wait_for_serving(health, deadline, retry_interval=0.01)
    assert health.calls >= 2


@pytest.mark.parametrize(
    ("model", "server", "message"),
    [
        ({}, {"api_version": "other"}, "api_version 'other'"),
        ({"model_id": "  "}, {}, "empty model_id"),
        ({"served_model_name": ""}, {}, "empty served_model_name"),
        ({"supports_token_ids_input": False}, {}, "token-id prompts"),
        ({}, {"kv_block_size": 0}, "block size of 0"),
        ({}, {"total_kv_blocks": 1}, "less than one block per rank"),
    ],
)
async def test_discovery_validation_failures(
    fake: FakeServer,
    start_sidecar: StartSidecar,
    model: dict[str, Any],
    server: dict[str, Any],
    message: str,
) -> None:
    fake.fake.model = model_info(**model)
    fake.fake.server = server_info(**server)
    with pytest.raises(DiscoveryError, match=message):
        await start_sidecar()


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ((0, 0, 0), "at least 1"),
        ((8, 4, 0), "must start at rank 0"),
        ((8, 0, 9), "outside the data-parallel group"),
        ((8, 4, 5), "outside the data-parallel group"),
    ],
)
async def test_bad_dp_layouts_are_refused(
    fake: FakeServer, start_sidecar: StartSidecar, layout: tuple[int, int, int], message: str
) -> None:
    fake.fake.server = server_info(*layout)
    with pytest.raises(DiscoveryError, match=message):
        await start_sidecar()


async def test_partial_frontend_serves_its_slice(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.server = server_info(8, 4, 4, total_kv_blocks=400)
    sidecar = await start_sidecar()
    assert sidecar.info.ranks == (4, 5, 6, 7)
    assert sidecar.info.capacity[0] == RankCapacity(4, 100, 8)


async def test_engine_without_kv_event_sources_starts_and_logs_once(
    fake: FakeServer, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="rankgate.sidecar"):
        sidecar = await start_sidecar()
    assert sidecar.ready
    assert sidecar.info.kv_event_sources == ()
    assert caplog.text.count("KV-aware routing is off") == 1


async def test_kv_event_sources_are_validated_and_rewritten(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.kv_sources = [zmq_source(1, 7001), zmq_source(0, 7000)]
    sidecar = await start_sidecar()
    assert sidecar.info.kv_event_sources == (
        KvEventSource(0, "tcp://127.0.0.1:7000", "tcp://127.0.0.1:7100", "kv-events"),
        KvEventSource(1, "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7101", "kv-events"),
    )


async def test_kv_transfer_fallback_when_control_lacks_the_rpc(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.kv_sources = grpc.StatusCode.UNIMPLEMENTED
    fake.fake.kv_transfer_sources = [zmq_source(0, 7000), zmq_source(1, 7001)]
    sidecar = await start_sidecar()
    assert [s.rank for s in sidecar.info.kv_event_sources] == [0, 1]


async def test_neither_kv_rpc_means_kv_events_off(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.kv_sources = grpc.StatusCode.UNIMPLEMENTED
    sidecar = await start_sidecar()
    assert sidecar.info.kv_event_sources == ()


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([zmq_source(0, 7000)], r"no KV-event source for data-parallel ranks \[1\]"),
        ([zmq_source(0, 7000), zmq_source(0, 7001)], "two KV-event sources claim"),
        ([zmq_source(0, 7000), zmq_source(5, 7001)], "outside the served ranks"),
    ],
)
async def test_bad_kv_event_sources_are_refused(
    fake: FakeServer,
    start_sidecar: StartSidecar,
    sources: list[control_pb2.KvEventSource],
    message: str,
) -> None:
    fake.fake.kv_sources = sources
    with pytest.raises(DiscoveryError, match=message):
        await start_sidecar()


async def test_kv_sources_internal_error_is_a_discovery_error(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.kv_sources = grpc.StatusCode.INTERNAL
    with pytest.raises(DiscoveryError, match="GetKvEventSources failed"):
        await start_sidecar()


async def test_endpoint_with_a_path_is_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="must not contain a path"):
        Sidecar(SidecarConfig(endpoint="http://vllm:8000/v1"), FixedRouter())


async def test_served_model_name_override(fake: FakeServer, start_sidecar: StartSidecar) -> None:
    sidecar = await start_sidecar(served_model_name="public-name")
    assert sidecar.info.served_model_name == "public-name"
    assert "fake" in sidecar.info.aliases
