"""The health watch after startup: readiness follows vLLM, restarts are re-discovered and a
changed model or layout is refused instead of served."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from rankgate.sidecar.endpoint import parse_endpoint
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.errors import EngineUnavailable
from rankgate.sidecar.health import LeanProbe
from rankgate.sidecar.inference_client import InferenceClient
from tests.sidecar.conftest import StartSidecar
from tests.sidecar.fake_vllm import (
    NOT_SERVING,
    SERVING,
    FakeServer,
    collect,
    model_info,
    request,
    server_info,
)
from tests.sidecar.routers import FixedRouter
from tests.support.polling import until


async def test_readiness_follows_engine_health(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar()
    fake.fake.health["vllm.Inference"] = NOT_SERVING
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    with pytest.raises(EngineUnavailable, match=r"vllm\.Inference is NOT_SERVING") as caught:
        await collect(sidecar.generate(request()))
    assert caught.value.retry_after >= 1.0
    with pytest.raises(EngineUnavailable):
        _ = sidecar.info
    fake.fake.health["vllm.Inference"] = SERVING
    await until(lambda: sidecar.ready, 10, "the sidecar is ready again")
    # Three tokens, in as many deltas as the reader's pace merges them into.
    deltas = await collect(sidecar.generate(request()))
    assert sum(len(delta.token_ids) for delta in deltas) == 3


async def test_engine_process_gone_and_back(fake: FakeServer, start_sidecar: StartSidecar) -> None:
    router = FixedRouter()
    sidecar = await start_sidecar(router)
    port = fake.port
    await fake.stop()
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    with pytest.raises(EngineUnavailable):
        await collect(sidecar.generate(request()))
    fake.fake.server = server_info(instance_id="fake-2")
    await fake.start(port)
    await until(lambda: sidecar.ready, 10, "the sidecar is ready again")
    assert sidecar.info.instance_id == "fake-2"
    # A new instance has an empty cache: the router rebuilt its per-rank state.
    assert [info.instance_id for info in router.configured] == ["fake-1", "fake-2"]
    # Three tokens, in as many deltas as the reader's pace merges them into.
    deltas = await collect(sidecar.generate(request()))
    assert sum(len(delta.token_ids) for delta in deltas) == 3


async def test_admission_is_resized_when_a_restart_changes_capacity(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar()
    assert sidecar.admission.limit == {0: 16, 1: 16}
    port = fake.port
    await fake.stop()
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    fake.fake.server = server_info(instance_id="fake-2", max_running_requests=3)
    await fake.start(port)
    await until(lambda: sidecar.ready, 10, "the sidecar is ready again")
    assert sidecar.admission.limit == {0: 6, 1: 6}
    # Three tokens, in as many deltas as the reader's pace merges them into.
    deltas = await collect(sidecar.generate(request()))
    assert sum(len(delta.token_ids) for delta in deltas) == 3
    assert sidecar.admission.in_use == 0


async def test_changed_model_after_restart_is_refused_loudly(
    fake: FakeServer, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    sidecar = await start_sidecar()
    fake.fake.health["vllm.Control"] = NOT_SERVING
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    fake.fake.model = model_info(model_id="org/other")
    with caplog.at_level(logging.ERROR, logger="rankgate.sidecar"):
        fake.fake.health["vllm.Control"] = SERVING
        await until(
            lambda: "model_id: 'org/fake' -> 'org/other'" in caplog.text,
            10,
            "the changed model is logged",
        )
    assert not sidecar.ready
    with pytest.raises(EngineUnavailable, match="changed since startup"):
        await collect(sidecar.generate(request()))
    # Logged once per distinct problem, not once per poll.
    assert caplog.text.count("changed since startup") == 1
    fake.fake.model = model_info()
    await until(lambda: sidecar.ready, 10, "the sidecar is ready again")


async def test_topology_change_between_discovery_passes_is_rejected(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar()
    fake.fake.server = server_info(dp_size=4, instance_id="fake-2")
    fake.fake.health["vllm.Inference"] = NOT_SERVING
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    fake.fake.health["vllm.Inference"] = SERVING
    await until(
        lambda: "data_parallel_size: 2 -> 4" in _problem(sidecar),
        10,
        lambda: f"the problem said is {_problem(sidecar)!r}",
    )
    assert not sidecar.ready


async def test_restart_missed_by_health_is_caught_by_periodic_verification(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    router = FixedRouter()
    sidecar = await start_sidecar(router)
    # Same model, new instance, and health never went down between two polls.
    fake.fake.server = server_info(instance_id="fake-3")
    await until(
        lambda: sidecar.info.instance_id == "fake-3",
        5,
        lambda: f"the sidecar serves instance {sidecar.info.instance_id!r}",
    )
    assert router.configured[-1].instance_id == "fake-3"
    assert sidecar.ready


async def test_block_size_change_while_serving_drops_readiness(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar()
    fake.fake.server = server_info(kv_block_size=32)
    await until(lambda: not sidecar.ready, 5, "the sidecar stops being ready")
    assert "block_size: 16 -> 32" in _problem(sidecar)


def _problem(sidecar: Sidecar) -> str:
    try:
        _ = sidecar.info
    except EngineUnavailable as error:
        return error.message
    return ""


async def test_timed_out_probes_drop_readiness_only_when_they_persist(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(health_interval=0.5)
    before = fake.fake.health_checks
    fake.fake.health["vllm.Control"] = grpc.StatusCode.DEADLINE_EXCEEDED
    await until(
        lambda: fake.fake.health_checks >= before + 2,
        10,
        lambda: f"{fake.fake.health_checks} health checks",
    )
    assert sidecar.ready, "two timed-out probes in a row must not turn requests away"
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    assert fake.fake.health_checks >= before + 3
    fake.fake.health["vllm.Control"] = SERVING
    await until(lambda: sidecar.ready, 10, "the sidecar is ready again")


async def test_the_watch_probes_on_the_lean_connection_the_requests_use(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    """The startup wait probes through grpcio; every probe after it comes over the lean
    HTTP/2 client (user agent ``rankgate`` alone, where grpcio adds its own name)."""
    sidecar = await start_sidecar(health_interval=0.2)
    started = len(fake.fake.health_agents)
    await until(
        lambda: len(fake.fake.health_agents) >= started + 4,
        10,
        lambda: f"{len(fake.fake.health_agents)} health checks",
    )
    assert sidecar.ready
    assert all(agent.startswith("rankgate grpc-") for agent in fake.fake.health_agents[:started])
    assert set(fake.fake.health_agents[started:]) == {"rankgate"}


async def test_a_probe_left_unanswered_is_given_up_and_counts_as_timed_out(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    """A probe that gets no answer within its timeout (the interval, at least 1 s) is
    cancelled on the engine and counts as a timed-out probe: readiness drops only once three
    in a row went unanswered, and returns with the answers."""
    sidecar = await start_sidecar(health_interval=0.2)
    fake.fake.health_stall = 30.0
    await until(
        lambda: fake.fake.health_cancelled >= 2,
        10,
        lambda: f"{fake.fake.health_cancelled} health checks cancelled",
    )
    assert sidecar.ready, "two unanswered probes in a row must not turn requests away"
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    assert "DEADLINE_EXCEEDED" in _problem(sidecar)
    fake.fake.health_stall = 0.0
    await until(lambda: sidecar.ready, 10, "the sidecar is ready again")


async def test_a_probe_cancelled_by_its_caller_is_cancelled_on_the_engine(
    fake: FakeServer,
) -> None:
    """The watch closing mid-probe leaves no Check running on the engine, while the
    connection the requests use stays open."""
    client = InferenceClient(parse_endpoint(f"127.0.0.1:{fake.port}"), 1 << 20)
    try:
        fake.fake.health_stall = 30.0
        probe = asyncio.get_running_loop().create_task(LeanProbe(client, 60.0)("vllm.Control"))
        await until(
            lambda: fake.fake.health_checks >= 1,
            10,
            lambda: f"{fake.fake.health_checks} health checks",
        )
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        await until(
            lambda: fake.fake.health_cancelled == 1,
            10,
            lambda: f"{fake.fake.health_cancelled} health checks cancelled",
        )
        fake.fake.health_stall = 0.0
        assert await LeanProbe(client, 60.0)("vllm.Control") is None
    finally:
        await client.close()


async def test_a_health_service_that_does_not_know_vllm_drops_readiness(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    """UNIMPLEMENTED or NOT_FOUND after startup: the endpoint is no longer the vLLM it was
    (another server took the port), which the watch reports as such at once."""
    sidecar = await start_sidecar(health_interval=0.2)
    fake.fake.health["vllm.Control"] = grpc.StatusCode.UNIMPLEMENTED
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    assert "not a vLLM gRPC server" in _problem(sidecar)
    fake.fake.health["vllm.Control"] = SERVING
    await until(lambda: sidecar.ready, 10, "the sidecar is ready again")


async def test_an_explicit_not_serving_drops_readiness_at_once(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(health_interval=0.5)
    before = fake.fake.health_checks
    fake.fake.health["vllm.Control"] = NOT_SERVING
    await until(lambda: not sidecar.ready, 10, "the sidecar stops being ready")
    assert fake.fake.health_checks <= before + 2
