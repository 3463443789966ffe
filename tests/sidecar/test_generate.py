"""Generation through the fake engine: conversion on the wire, rank pinning, fan-out, errors,
cancellation and the per-rank in-flight view."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from rankgate.sidecar.errors import (
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
    NotFound,
)
from rankgate.sidecar.routing.hashing import SALT_TAG
from rankgate.sidecar.streams import UNPINNED_RANK
from rankgate.sidecar.types import SamplingParams, StoppingParams
from rankgate.wire.proto.vllm import inference_pb2
from tests.sidecar.conftest import StartSidecar
from tests.sidecar.fake_vllm import FakeServer, collect, request, token_step
from tests.sidecar.routers import FixedRouter
from tests.support.polling import until


async def test_single_choice_stream(fake: FakeServer, start_sidecar: StartSidecar) -> None:
    router = FixedRouter(rank=None)
    sidecar = await start_sidecar(router)
    deltas = await collect(sidecar.generate(request("a", cache_salt="s1")))
    # Messages already waiting when the reader gets to them arrive merged.
    assert "".join(d.text for d in deltas) == "t0 t1 t2 "
    assert [t for d in deltas for t in d.token_ids] == [100, 101, 102]
    assert deltas[0].prompt_tokens == 3
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 3
    (received,) = fake.fake.received
    sent = received.request
    assert sent.request_id == "a-0"
    assert sent.model == "fake"
    assert sent.HasField("temperature")
    assert sent.kv.cache_salt == SALT_TAG + "s1"
    assert received.rank is None
    (ticket,) = router.tickets
    assert (ticket.first_tokens, ticket.finishes) == (1, 1)
    assert sidecar.in_flight() == {0: 0, 1: 0}


@pytest.mark.parametrize("rank", [0, 1])
async def test_router_rank_is_pinned_in_metadata(
    fake: FakeServer, start_sidecar: StartSidecar, rank: int
) -> None:
    sidecar = await start_sidecar(FixedRouter(rank=rank))
    await collect(sidecar.generate(request()))
    assert [r.rank for r in fake.fake.received] == [str(rank)]


async def test_request_rank_overrides_the_router(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(FixedRouter(rank=0))
    await collect(sidecar.generate(request(rank=1)))
    assert [r.rank for r in fake.fake.received] == ["1"]


async def test_unserved_rank_is_refused_before_the_engine_sees_it(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar()
    with pytest.raises(InvalidRequest, match=r"rank 7 is not served here; served ranks: \[0, 1\]"):
        await collect(sidecar.generate(request(rank=7)))
    assert fake.fake.received == []


async def test_invalid_request_never_reaches_the_engine(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    router = FixedRouter()
    sidecar = await start_sidecar(router)
    with pytest.raises(InvalidRequest, match="cannot be encoded"):
        await collect(sidecar.generate(request(stopping=StoppingParams(max_tokens=-1))))
    assert fake.fake.received == []
    assert router.tickets == []


async def test_n_choices_fan_out_and_interleave(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.token_delay = 0.01
    router = FixedRouter(rank=1)
    sidecar = await start_sidecar(router)
    deltas = await collect(
        sidecar.generate(request("m", n=3, sampling=SamplingParams(temperature=0.9, seed=10)))
    )
    sent = sorted(fake.fake.received, key=lambda r: r.request.request_id)
    assert [r.request.request_id for r in sent] == ["m-0", "m-1", "m-2"]
    assert [r.request.sampling.seed for r in sent] == [10, 11, 12]
    assert all(r.rank == "1" for r in sent)
    by_choice: dict[int, list[str]] = {}
    for delta in deltas:
        by_choice.setdefault(delta.index, []).append(delta.text)
    assert by_choice == {i: ["t0 ", "t1 ", "t2 "] for i in range(3)}
    # Interleaved as they arrive, not choice after choice.
    assert [d.index for d in deltas[:3]] != [0, 0, 0]
    finals = [d for d in deltas if d.finish_reason]
    assert sorted(d.index for d in finals) == [0, 1, 2]
    assert all((t.first_tokens, t.finishes) == (1, 1) for t in router.tickets)
    assert sidecar.in_flight() == {0: 0, 1: 0}


def failing_stream(code: grpc.StatusCode, details: str, after: int = 0) -> Any:
    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        yield inference_pb2.GenerateResponse(
            prompt_info=inference_pb2.PromptInfo(num_prompt_tokens=3)
        )
        for i in range(after):
            yield inference_pb2.GenerateResponse(
                outputs=inference_pb2.SequenceOutput(text="x", token_ids=[i])
            )
        await context.abort(code, details)

    return stream


@pytest.mark.parametrize(
    ("code", "kind", "message"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest, "^top_k must be >= -1$"),
        (grpc.StatusCode.NOT_FOUND, NotFound, "^The model `x` does not exist$"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, EngineOverloaded, "overloaded"),
        (grpc.StatusCode.UNAVAILABLE, EngineUnavailable, "unavailable"),
        (grpc.StatusCode.INTERNAL, EngineFailure, "INTERNAL"),
    ],
)
async def test_engine_status_becomes_a_typed_error(
    fake: FakeServer,
    start_sidecar: StartSidecar,
    code: grpc.StatusCode,
    kind: type[Exception],
    message: str,
) -> None:
    details = {
        grpc.StatusCode.INVALID_ARGUMENT: "top_k must be >= -1",
        grpc.StatusCode.NOT_FOUND: "The model `x` does not exist",
    }.get(code, "engine said no")
    fake.fake.stream = failing_stream(code, details)
    router = FixedRouter(rank=0)
    sidecar = await start_sidecar(router)
    with pytest.raises(kind, match=message):
        await collect(sidecar.generate(request()))
    assert router.tickets[0].finishes == 1
    assert sidecar.in_flight() == {0: 0, 1: 0}


async def test_mid_stream_failure_after_tokens(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.stream = failing_stream(grpc.StatusCode.INTERNAL, "engine core died", after=2)
    sidecar = await start_sidecar()
    stream = sidecar.generate(request())
    received = [await anext(stream)]
    while sum(len(d.token_ids) for d in received) < 2:
        received.append(await anext(stream))
    with pytest.raises(EngineFailure, match="engine core died"):
        await anext(stream)
    assert [t for d in received for t in d.token_ids] == [0, 1]


async def test_stream_without_finish_info_is_an_error(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    async def truncated(request: Any, context: Any) -> AsyncIterator[Any]:
        yield inference_pb2.GenerateResponse(
            outputs=inference_pb2.SequenceOutput(text="partial", token_ids=[5])
        )

    fake.fake.stream = truncated
    sidecar = await start_sidecar()
    with pytest.raises(EngineFailure, match="ended request r-0 without finishing it"):
        await collect(sidecar.generate(request()))


async def test_one_failing_choice_fails_the_request_and_drops_the_others(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        if request.request_id.endswith("-1"):
            # Fail only once the other choices run, so that dropping them is observable.
            await until(
                lambda: len(fake.fake.active) == 3,
                10,
                lambda: f"active: {sorted(fake.fake.active)}",
            )
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad choice")
        while True:
            yield inference_pb2.GenerateResponse(
                outputs=inference_pb2.SequenceOutput(text="x", token_ids=[1])
            )
            await token_step()

    fake.fake.stream = stream
    sidecar = await start_sidecar()
    with pytest.raises(InvalidRequest, match="bad choice"):
        await collect(sidecar.generate(request(n=3)))
    await until(
        lambda: not fake.fake.active, 10, lambda: f"still active: {sorted(fake.fake.active)}"
    )
    assert sorted(fake.fake.dropped) == ["r-0", "r-2"]
    assert sidecar.in_flight() == {0: 0, 1: 0}


async def test_closing_the_stream_drops_every_call(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.token_delay = 0.05
    router = FixedRouter(rank=0)
    sidecar = await start_sidecar(router)
    stream = sidecar.generate(request("c", n=2, stopping=StoppingParams(max_tokens=1000)))
    first = await anext(stream)
    assert first.text == "t0 "
    assert sidecar.in_flight()[0] == 2
    await stream.aclose()
    assert sidecar.in_flight() == {0: 0, 1: 0}
    await until(
        lambda: sorted(fake.fake.dropped) == ["c-0", "c-1"],
        10,
        lambda: f"dropped: {fake.fake.dropped}",
    )
    assert not fake.fake.active
    assert all(t.finishes == 1 for t in router.tickets)


async def test_cancelling_the_consumer_drops_the_call(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.token_delay = 0.05
    sidecar = await start_sidecar(FixedRouter(rank=None))

    async def consume() -> None:
        async for _ in sidecar.generate(request("k", stopping=StoppingParams(max_tokens=1000))):
            pass

    task = asyncio.ensure_future(consume())
    await until(
        lambda: "k-0" in fake.fake.active, 10, lambda: f"active: {sorted(fake.fake.active)}"
    )
    assert sidecar.in_flight()[UNPINNED_RANK] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(
        lambda: fake.fake.dropped == ["k-0"],
        10,
        lambda: f"dropped: {fake.fake.dropped}",
    )
    assert sidecar.in_flight() == {0: 0, 1: 0}


async def test_close_preempts_in_flight_streams(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.token_delay = 0.05
    sidecar = await start_sidecar()
    stream = sidecar.generate(request(stopping=StoppingParams(max_tokens=1000)))
    await anext(stream)
    reading = asyncio.ensure_future(collect(stream))
    await asyncio.sleep(0)  # the reader is waiting on the stream
    await sidecar.close()
    with pytest.raises(EngineUnavailable, match="shutting down"):
        await reading
    assert not sidecar.ready
    await until(
        lambda: not fake.fake.active, 10, lambda: f"still active: {sorted(fake.fake.active)}"
    )


async def test_decode_handoff_is_read_until_its_first_token(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    release = asyncio.Event()

    async def slow_first_token(request: Any, context: Any) -> AsyncIterator[Any]:
        yield inference_pb2.GenerateResponse(
            prompt_info=inference_pb2.PromptInfo(num_prompt_tokens=3)
        )
        await release.wait()
        while True:
            yield inference_pb2.GenerateResponse(
                outputs=inference_pb2.SequenceOutput(text="x", token_ids=[1])
            )
            await token_step()

    fake.fake.stream = slow_first_token
    router = FixedRouter(rank=1)
    sidecar = await start_sidecar(router)
    handoff = request("d", kv_transfer_params={"do_remote_prefill": True, "remote_port": 1})
    task = asyncio.ensure_future(collect(sidecar.generate(handoff)))
    await until(
        lambda: "d-0" in fake.fake.active, 10, lambda: f"active: {sorted(fake.fake.active)}"
    )
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # A later request through the same channel finishes, so a drop sent at the cancel would
    # have reached the engine before it.
    fake.fake.stream = None
    assert (await collect(sidecar.generate(request("e"))))[-1].finish_reason == "length"
    # Still attached: dropping it now could strand the transferred KV.
    assert "d-0" in fake.fake.active
    assert sidecar.in_flight()[1] == 1
    release.set()
    await until(
        lambda: fake.fake.dropped == ["d-0"],
        10,
        lambda: f"dropped: {fake.fake.dropped}",
    )
    await until(
        lambda: sidecar.in_flight() == {0: 0, 1: 0},
        10,
        lambda: f"in flight: {sidecar.in_flight()}",
    )
    assert router.tickets[0].finishes == 1
    assert fake.fake.aborts == []


async def test_stuck_decode_handoff_is_dropped_at_its_timeout(
    fake: FakeServer, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fake.token_delay = 30.0  # the first token never comes by itself
    sidecar = await start_sidecar(decode_handoff_timeout=0.3)
    handoff = request("h", kv_transfer_params={"do_remote_prefill": True})
    stream = sidecar.generate(handoff)
    reading = asyncio.ensure_future(anext(stream))
    await until(
        lambda: "h-0" in fake.fake.active, 10, lambda: f"active: {sorted(fake.fake.active)}"
    )
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    with caplog.at_level(logging.WARNING, logger="rankgate.sidecar"):
        await stream.aclose()
        # A later request through the same channel finishes (the first token of h-0 is still
        # 30 s away), so a drop sent at the close would have reached the engine before it.
        fake.fake.token_delay = 0.0
        assert (await collect(sidecar.generate(request("p"))))[-1].finish_reason == "length"
        assert "h-0" in fake.fake.active
        await until(
            lambda: not fake.fake.active, 10, lambda: f"still active: {sorted(fake.fake.active)}"
        )
    # The hand-off timeout dropped it, not the close.
    assert "decode request h-0 had no first token 0.3 s after its client left" in caplog.text
    # Dropped, never aborted through Control: a dropped stream is the whole contract.
    assert fake.fake.aborts == []
    assert fake.fake.dropped == ["h-0"]
    await until(
        lambda: sidecar.in_flight() == {0: 0, 1: 0},
        10,
        lambda: f"in flight: {sidecar.in_flight()}",
    )


async def test_abort_expands_a_gateway_request_id(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    fake.fake.token_delay = 0.05
    sidecar = await start_sidecar()
    stream = sidecar.generate(request("g", n=2, stopping=StoppingParams(max_tokens=1000)))
    await anext(stream)
    await sidecar.abort(["g"])
    assert sorted(fake.fake.aborts) == ["g-0", "g-1"]
    deltas = await collect(stream)
    assert sorted(d.index for d in deltas if d.finish_reason == "abort") == [0, 1]
    assert sidecar.in_flight() == {0: 0, 1: 0}


async def test_list_loras_is_cached(fake: FakeServer, start_sidecar: StartSidecar) -> None:
    sidecar = await start_sidecar()
    assert await sidecar.list_loras() == ("a", "b")
    assert await sidecar.list_loras() == ("a", "b")


async def test_generate_before_start_is_unavailable(fake: FakeServer) -> None:
    from rankgate.sidecar.config import SidecarConfig
    from rankgate.sidecar.engine import Sidecar

    sidecar = Sidecar(SidecarConfig(endpoint=fake.target), FixedRouter())
    with pytest.raises(EngineUnavailable) as caught:
        await collect(sidecar.generate(request()))
    assert caught.value.retry_after >= 1.0
