"""The gRPC surface: services, validation, cancellation and the counters tests rely on."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rankgate.wire.proto.vllm import control_pb2, inference_pb2
from tests.mocker.conftest import Client, engine, prompt, request
from tests.support.mock_engine import MockEngineHandle
from tests.support.polling import wait_until


def test_health_reports_every_service(mock: MockEngineHandle, client: Client) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "vllm.Inference", "vllm.Control"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_unneeded_control_rpcs_are_unimplemented(client: Client) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        client.control.Shutdown(control_pb2.ShutdownRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_stream_shape_and_counters(mock: MockEngineHandle, client: Client) -> None:
    before = mock.stats(1)
    messages = client.stream(request(prompt(1, 40), max_new_tokens=5), rank=1)
    assert messages[0].HasField("prompt_info")
    assert not messages[0].HasField("outputs")
    assert messages[0].prompt_info.num_prompt_tokens == 40
    assert all(not m.HasField("prompt_info") for m in messages[1:])
    assert all(not m.outputs.HasField("finish_info") for m in messages[1:-1])
    finish = messages[-1].outputs.finish_info
    assert finish.finish_reason == inference_pb2.FinishInfo.LENGTH
    assert finish.num_output_tokens == 5
    tokens = [t for m in messages[1:] for t in m.outputs.token_ids]
    assert len(tokens) == 5
    after = mock.stats(1)
    assert after.requests_served == before.requests_served + 1
    assert after.prompt_tokens == before.prompt_tokens + 40
    assert after.generated_tokens == before.generated_tokens + 5
    assert mock.stats(0).requests_served == mock.stats(0).requests_served


def test_output_is_deterministic_for_a_prompt(client: Client) -> None:
    first = client.stream(request(prompt(2, 20), max_new_tokens=8), rank=0)
    second = client.stream(request(prompt(2, 20), max_new_tokens=8), rank=1)
    assert [t for m in first[1:] for t in m.outputs.token_ids] == [
        t for m in second[1:] for t in m.outputs.token_ids
    ]


def test_unary_generate_collects_everything(client: Client) -> None:
    reply = client.inference.Generate(request(prompt(3, 20), max_new_tokens=6), timeout=10)
    assert reply.prompt_info.num_prompt_tokens == 20
    assert len(reply.outputs.token_ids) == 6
    assert reply.outputs.text
    assert reply.outputs.finish_info.finish_reason == inference_pb2.FinishInfo.LENGTH


def test_text_prompt_is_refused_when_token_only() -> None:
    with engine(supports_text_input=False, kv_events_port=None) as handle:
        c = Client(handle.target)
        try:
            info = c.control.GetModelInfo(control_pb2.GetModelInfoRequest(), timeout=5)
            assert not info.supports_text_input
            with pytest.raises(grpc.RpcError) as caught:
                c.inference.Generate(inference_pb2.GenerateRequest(text="hi"), timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "token_ids" in (caught.value.details() or "")
        finally:
            c.close()


def test_no_kv_sources_when_events_are_off() -> None:
    with engine(kv_events_port=None) as handle:
        c = Client(handle.target)
        try:
            reply = c.control.GetKvEventSources(control_pb2.GetKvEventSourcesRequest(), timeout=5)
            assert list(reply.sources) == []
        finally:
            c.close()


def slow_engine(**overrides: object):
    return engine(**{"speed": 1.0, "decode_step_seconds": 0.02, **overrides})


def test_abort_ends_the_stream_and_frees_blocks() -> None:
    with slow_engine() as handle:
        c = Client(handle.target)
        try:
            free = handle.stats(0).kv_blocks_free
            stream = c.inference.GenerateStream(
                request(prompt(4, 64), max_new_tokens=500, request_id="to-abort"),
                metadata=(("x-data-parallel-rank", "0"),),
                timeout=30,
            )
            first = next(stream)
            assert first.HasField("prompt_info")
            next(stream)
            c.control.Abort(control_pb2.AbortRequest(request_ids=["to-abort"]), timeout=5)
            rest = list(stream)
            assert rest[-1].outputs.finish_info.finish_reason == inference_pb2.FinishInfo.ABORTED
            handle.wait_idle()
            stats = handle.stats(0)
            assert stats.aborts == 1
            assert stats.requests_served == 0
            assert stats.leaked == 0
            assert stats.active == 0
            # The prompt's full blocks stay cached (evictable), so all blocks are free again.
            assert stats.kv_blocks_free == free
        finally:
            c.close()


def test_dropped_stream_aborts_the_request() -> None:
    with slow_engine() as handle:
        c = Client(handle.target)
        try:
            stream = c.inference.GenerateStream(
                request(prompt(5, 20), max_new_tokens=500), timeout=30
            )
            next(stream)
            next(stream)
            stream.cancel()
            wait_until(lambda: handle.stats(0).aborts, 5, "the dropped stream aborted")
            handle.wait_idle()
            stats = handle.stats(0)
            assert stats.aborts == 1
            assert stats.active == 0
            assert stats.leaked == 0
        finally:
            c.close()


def test_duplicate_request_id_in_flight_is_refused() -> None:
    with slow_engine() as handle:
        c = Client(handle.target)
        try:
            stream = c.inference.GenerateStream(
                request(prompt(6, 20), max_new_tokens=200, request_id="dup"),
                metadata=(("x-data-parallel-rank", "1"),),
                timeout=30,
            )
            next(stream)
            with pytest.raises(grpc.RpcError) as caught:
                c.stream(request(prompt(6, 20), request_id="dup"), rank=1)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "already in flight" in (caught.value.details() or "")
            stream.cancel()
        finally:
            c.close()


def test_prefill_answer_carries_kv_transfer_params(client: Client) -> None:
    req = request(prompt(7, 40), max_new_tokens=1)
    req.kv.kv_transfer_params.update({"do_remote_decode": True})
    messages = client.stream(req, rank=1)
    params = messages[-1].outputs.finish_info.kv_transfer_params
    assert params["do_remote_prefill"] is True
    assert params["remote_engine_id"].endswith("-dp1")
    # vLLM's NIXL fields and JSON types: numbers stay numbers (doubles in a Struct).
    assert isinstance(params["remote_port"], float)
    assert params["remote_request_id"]
    assert {"tp_size", "dcp_size", "pp_size", "remote_num_tokens"} <= set(params)
    assert len(params["remote_block_ids"][0]) >= 40 // 16


def test_decode_cancelled_before_its_first_token_strands_the_transfer() -> None:
    with slow_engine(decode_step_seconds=0.5) as handle:
        c = Client(handle.target)
        try:
            req = request(prompt(8, 40), max_new_tokens=5, request_id="decode-1")
            req.kv.kv_transfer_params.update({"do_remote_prefill": True})
            stream = c.inference.GenerateStream(
                req, metadata=(("x-data-parallel-rank", "0"),), timeout=30
            )
            assert next(stream).HasField("prompt_info")
            stream.cancel()
            wait_until(lambda: handle.stats(0).stranded_transfers, 5, "the transfer stranded")
            assert handle.stats(0).stranded_transfers == 1
        finally:
            c.close()


def test_concurrent_streams_all_finish(mock: MockEngineHandle) -> None:
    results: list[int] = []

    def worker(seed: int) -> None:
        c = Client(mock.target)
        try:
            messages = c.stream(request(prompt(seed, 30), max_new_tokens=6))
            results.append(messages[-1].outputs.finish_info.num_output_tokens)
        finally:
            c.close()

    threads = [threading.Thread(target=worker, args=(100 + i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [6] * 8
    mock.wait_idle()
    assert all(mock.stats(rank).leaked == 0 for rank in mock.ranks)


def test_model_seed_changes_the_continuation() -> None:
    outputs = []
    for seed in (0, 0, 1):
        with engine(seed=seed, kv_events_port=None) as handle:
            c = Client(handle.target)
            try:
                reply = c.inference.Generate(request(prompt(9, 20), max_new_tokens=8), timeout=10)
                outputs.append(list(reply.outputs.token_ids))
            finally:
                c.close()
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]
