"""Fixtures the conformance modules share: stubs, the tokenizer and the advertised KV sources."""

from __future__ import annotations

import grpc
import pytest
from tokenizers import Tokenizer

from sidecar.proto.vllm import control_pb2, control_pb2_grpc, inference_pb2_grpc
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
