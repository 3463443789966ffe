"""Requests vLLM refuses, with the status a gateway has to map; the engine keeps serving after."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance.helpers import make_request, prompt_ids, rpc_error, stream, unary

pytestmark = pytest.mark.timeout(120)

MAX_MODEL_LEN = 512
CALLS: dict[str, Callable[[grpc.Channel, inference_pb2.GenerateRequest], Any]] = {
    "stream": lambda channel, request: stream(channel, request, rank=0),
    "unary": lambda channel, request: unary(channel, request, rank=0),
}


def refused(
    channel: grpc.Channel, call: str, request: inference_pb2.GenerateRequest
) -> grpc.RpcError:
    return rpc_error(lambda: CALLS[call](channel, request))


@pytest.mark.parametrize("call", sorted(CALLS))
def test_several_sequences_are_rejected(engine_channel: grpc.Channel, call: str) -> None:
    request = make_request(
        prompt_ids("n-seq", 8), sampling=inference_pb2.RandomSampling(num_sequences=2)
    )
    error = refused(engine_channel, call, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "num_sequences > 1 is not supported"


def test_one_sequence_is_fine(engine_channel: grpc.Channel) -> None:
    request = make_request(
        prompt_ids("n-seq", 8), sampling=inference_pb2.RandomSampling(num_sequences=1)
    )
    assert stream(engine_channel, request, rank=0).finish is not None


@pytest.mark.parametrize("call", sorted(CALLS))
def test_unknown_model_is_not_found(engine_channel: grpc.Channel, call: str) -> None:
    request = make_request(prompt_ids("model", 8), model="no-such-model")
    error = refused(engine_channel, call, request)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "model `no-such-model` not found"


def test_served_name_is_accepted(engine_channel: grpc.Channel, engine: Any) -> None:
    request = make_request(prompt_ids("model", 8), model=engine.served_model_name)
    assert stream(engine_channel, request, rank=0).finish is not None


def test_media_need_a_token_ids_prompt(engine_channel: grpc.Channel) -> None:
    request = inference_pb2.GenerateRequest(
        request_id="conf-media-text",
        text="describe this",
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=2),
        media=[
            inference_pb2.MediaItem(
                modality=inference_pb2.MODALITY_IMAGE,
                url="http://127.0.0.1:9/image.png",
                uuid="a" * 64,
            )
        ],
    )
    error = refused(engine_channel, "stream", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "multimodal gRPC requests must provide token_ids input"


def test_empty_prompt_is_rejected(engine_channel: grpc.Channel) -> None:
    error = refused(engine_channel, "stream", make_request([]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at least one prompt token" in (error.details() or "")


def test_prompt_longer_than_the_context_is_rejected(engine_channel: grpc.Channel) -> None:
    error = refused(engine_channel, "stream", make_request(prompt_ids("long", MAX_MODEL_LEN + 1)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in (error.details() or "")


def test_out_of_vocabulary_token_is_rejected(engine_channel: grpc.Channel) -> None:
    error = refused(engine_channel, "stream", make_request([300, 10_000_000]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "out of vocabulary" in (error.details() or "")
