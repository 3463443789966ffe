"""Fixtures the conformance modules share: stubs, the tokenizer and the advertised KV sources."""

from __future__ import annotations

import grpc
import pytest
from tokenizers import Tokenizer

from rankgate.sidecar.proto.vllm import control_pb2, control_pb2_grpc, inference_pb2_grpc
from tests.conformance import helpers
from tests.support.engines import EngineUnderTest


@pytest.fixture(scope="session")
def inference_stub(engine_channel: grpc.Channel) -> inference_pb2_grpc.InferenceStub:
    return helpers.inference(engine_channel)


@pytest.fixture(scope="session")
def control_stub(engine_channel: grpc.Channel) -> control_pb2_grpc.ControlStub:
    return helpers.control(engine_channel)


@pytest.fixture(scope="session")
def tokenizer(engine: EngineUnderTest) -> Tokenizer:
    return helpers.load_tokenizer(engine)


@pytest.fixture(scope="session")
def kv_sources(
    control_stub: control_pb2_grpc.ControlStub,
) -> list[control_pb2.KvEventSource]:
    reply = control_stub.GetKvEventSources(
        control_pb2.GetKvEventSourcesRequest(), timeout=helpers.RPC_TIMEOUT_S
    )
    return list(reply.sources)


@pytest.fixture(scope="session")
def warm_engine(engine_channel: grpc.Channel, engine: EngineUnderTest) -> None:
    """One short request per rank, so timing-sensitive tests do not meet a cold first request.

    Real vLLM's first stream after startup delivers its first token only after about a second,
    long enough for a whole generation to finish before the client can abort it.
    """
    for rank in range(engine.dp_size):
        request = helpers.make_request(helpers.fresh_prompt(8), tag="warm-up", max_new_tokens=2)
        helpers.stream(engine_channel, request, rank=rank)
