"""Requests that do not stream (``PreparedRequest.stream`` false) are served by unary
``Inference.Generate``: one whole-output delta per choice, the same output as the stream, the
same rank pinning and load accounting, and a consumer that leaves drops the call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from rankgate.sidecar.errors import (
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
)
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.types import OutputOptions, SamplingParams, StoppingParams
from rankgate.wire.proto.vllm import inference_pb2
from tests.sidecar import fake_vllm
from tests.sidecar.conftest import StartSidecar
from tests.sidecar.fake_vllm import FakeServer, collect, request
from tests.sidecar.routers import FixedRouter
from tests.sidecar.test_with_mocker import leaks, mock_engine, sidecar_on
from tests.support.polling import until

GREEDY = SamplingParams(temperature=0.0)


def _long(request_id: str, **overrides: Any) -> Any:
    stopping = StoppingParams(max_tokens=3000, ignore_eos=True)
    return request(request_id, stopping=stopping, **overrides)


async def test_one_delta_holds_the_whole_output_of_the_stream() -> None:
    # speed=1.0 paces tokens, so the stream really arrives in several messages.
    with mock_engine(speed=1.0) as handle:
        async with sidecar_on(handle, FixedRouter(rank=1)) as sidecar:
            stopping = StoppingParams(max_tokens=12, ignore_eos=True)
            output = OutputOptions(prompt_token_ids=True)
            streamed = await collect(
                sidecar.generate(request("s", stopping=stopping, sampling=GREEDY, output=output))
            )
            whole = await collect(
                sidecar.generate(
                    request("u", stopping=stopping, sampling=GREEDY, output=output, stream=False)
                )
            )
        stats = handle.stats(1)
    assert len(streamed) > 1
    assert len(whole) == 1
    delta = whole[0]
    assert delta.text == "".join(d.text for d in streamed)
    assert delta.token_ids == tuple(t for d in streamed for t in d.token_ids)
    assert len(delta.token_ids) == 12
    assert delta.prompt_tokens == streamed[0].prompt_tokens == 3
    assert delta.prompt_token_ids == (1, 2, 3)
    assert delta.completion_tokens == 12
    assert delta.finish_reason == "length"
    assert delta.rank == 1
    assert stats.requests_received == 2
    assert stats.requests_served == 2


async def test_n_choices_are_one_unary_call_each() -> None:
    with mock_engine() as handle:
        router = build_router(RoutingConfig(policy="round_robin"))
        async with sidecar_on(handle, router) as sidecar:
            deltas = await collect(
                sidecar.generate(
                    request(
                        "n",
                        n=3,
                        sampling=SamplingParams(temperature=1.0, seed=7),
                        stopping=StoppingParams(max_tokens=8, ignore_eos=True),
                        stream=False,
                    )
                )
            )
            assert sidecar.in_flight() == {0: 0, 1: 0}
        stats = handle.all_stats()
    assert sorted(d.index for d in deltas) == [0, 1, 2]
    assert all(d.finish_reason == "length" and len(d.token_ids) == 8 for d in deltas)
    assert all(d.prompt_tokens == 3 for d in deltas)
    # Seeds seed+i: the choices differ.
    assert len({d.token_ids for d in deltas}) > 1
    assert sum(s.requests_served for s in stats.values()) == 3


async def test_logprobs_of_every_token_arrive_in_the_reply() -> None:
    with mock_engine() as handle:
        async with sidecar_on(handle) as sidecar:
            (delta,) = await collect(
                sidecar.generate(
                    request(
                        "lp",
                        stopping=StoppingParams(max_tokens=5, ignore_eos=True),
                        output=OutputOptions(logprobs=2),
                        stream=False,
                    )
                )
            )
    assert delta.logprobs is not None
    assert [lp.token_id for lp in delta.logprobs] == list(delta.token_ids)
    assert all(len(lp.top) == 2 for lp in delta.logprobs)


async def test_the_router_ticket_sees_one_first_token_and_one_finish() -> None:
    with mock_engine() as handle:
        router = FixedRouter(rank=0)
        async with sidecar_on(handle, router) as sidecar:
            await collect(sidecar.generate(request("t", n=2, stream=False)))
    assert [(t.first_tokens, t.finishes) for t in router.tickets] == [(1, 1), (1, 1)]


@pytest.mark.parametrize("n", [1, 3])
async def test_a_consumer_that_leaves_drops_the_calls(n: int) -> None:
    """Only dropping the calls can stop requests that would otherwise run for minutes."""
    with mock_engine(speed=1.0, max_model_len=8192) as handle:
        router = FixedRouter(rank=0)
        async with sidecar_on(handle, router) as sidecar:
            stream = sidecar.generate(_long("gone", n=n, stream=False))
            task = asyncio.ensure_future(collect(stream))
            await until(
                lambda: handle.stats(0).active == n,
                10,
                lambda: f"{handle.stats(0).active} active on rank 0",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert sidecar.in_flight() == {0: 0, 1: 0}
            handle.wait_idle(timeout=5.0)
        stats = handle.stats(0)
        assert stats.aborts == n
        assert stats.requests_served == 0
        assert leaks(handle) == {0: (0, 0), 1: (0, 0)}
    assert all(t.finishes == 1 for t in router.tickets)


async def test_close_preempts_a_waiting_call_with_a_typed_error() -> None:
    with mock_engine(speed=1.0, max_model_len=8192) as handle:
        async with sidecar_on(handle) as sidecar:
            task = asyncio.ensure_future(collect(sidecar.generate(_long("pre", stream=False))))
            await until(
                lambda: handle.stats(0).active + handle.stats(1).active == 1,
                10,
                lambda: f"active per rank: {handle.active()}",
            )
            await sidecar.close()
            with pytest.raises(EngineUnavailable, match="shutting down"):
                await task


async def test_engine_errors_become_typed_errors() -> None:
    with mock_engine() as handle:
        async with sidecar_on(handle) as sidecar:
            with pytest.raises(InvalidRequest):
                await collect(sidecar.generate(request(prompt_token_ids=(10**8,), stream=False)))
            handle.faults.reject_requests(1, "too many requests")
            with pytest.raises(EngineOverloaded, match="too many requests"):
                await collect(sidecar.generate(request(stream=False)))
            assert sidecar.in_flight() == {0: 0, 1: 0}
            assert sidecar.ready


async def test_engine_death_during_a_call_is_typed_and_releases_the_request() -> None:
    with mock_engine(speed=1.0) as handle:
        async with sidecar_on(handle, FixedRouter(rank=0)) as sidecar:
            handle.faults.kill_after_tokens(3)
            with pytest.raises((EngineFailure, EngineUnavailable)):
                await collect(sidecar.generate(_long("dead", stream=False)))
            assert sidecar.in_flight() == {0: 0, 1: 0}


class _UnfinishedReply(fake_vllm._Inference):
    """A unary reply with tokens but no finish_info: not a whole output."""

    async def Generate(self, request: Any, context: Any) -> Any:
        return inference_pb2.GenerateResponse(
            prompt_info=inference_pb2.PromptInfo(num_prompt_tokens=3),
            outputs=inference_pb2.SequenceOutput(text="t0 ", token_ids=[100], num_tokens=1),
        )


@pytest.fixture
async def unfinished(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeServer]:
    monkeypatch.setattr(fake_vllm, "_Inference", _UnfinishedReply)
    server = FakeServer(fake_vllm.FakeVllm())
    await server.start()
    yield server
    await server.stop()


async def test_a_reply_without_a_finish_is_an_engine_failure(
    unfinished: FakeServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(endpoint=unfinished.target)
    with pytest.raises(EngineFailure, match="without finishing"):
        await collect(sidecar.generate(request(stream=False)))
    assert sidecar.in_flight() == {0: 0, 1: 0}


async def test_the_stream_is_still_used_when_streaming(
    fake: FakeServer, start_sidecar: StartSidecar
) -> None:
    """The purpose-built fake serves only GenerateStream: a streaming request never calls
    Generate, which the fake would answer UNIMPLEMENTED."""
    sidecar = await start_sidecar()
    deltas = await collect(sidecar.generate(request()))
    assert deltas[-1].finish_reason == "length"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _raw_unary(fake.target)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def _raw_unary(target: str) -> Any:
    from rankgate.wire.proto.vllm import inference_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub: Any = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        return await stub.Generate(inference_pb2.GenerateRequest(request_id="x"))
