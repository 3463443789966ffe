"""Fixtures the conformance modules share: stubs, the tokenizer and the advertised KV sources."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer

from rankgate.wire.proto.vllm import (
    control_pb2,
    control_pb2_grpc,
    inference_pb2_grpc,
    kv_transfer_pb2_grpc,
)
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
    engine: EngineUnderTest,
    engine_channel: grpc.Channel,
    control_stub: control_pb2_grpc.ControlStub,
) -> list[control_pb2.KvEventSource]:
    """Where the engine says its KV events are published: on vllm.Control, or on
    vllm.KvTransfer for the split layout, whose Control answers UNIMPLEMENTED."""
    request = control_pb2.GetKvEventSourcesRequest()
    if engine.grpc_services == "split":
        with pytest.raises(grpc.RpcError) as moved:
            control_stub.GetKvEventSources(request, timeout=helpers.RPC_TIMEOUT_S)
        assert moved.value.code() == grpc.StatusCode.UNIMPLEMENTED
        stub: Any = kv_transfer_pb2_grpc.KvTransferStub(engine_channel)  # type: ignore[no-untyped-call]
        reply = stub.GetKvEventSources(request, timeout=helpers.RPC_TIMEOUT_S)
    else:
        reply = control_stub.GetKvEventSources(request, timeout=helpers.RPC_TIMEOUT_S)
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
