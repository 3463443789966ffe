"""What Control discovery reports: the values the gateway validates and sizes its routing on."""

from __future__ import annotations

import grpc
import pytest

from rankgate.wire.proto.vllm import control_pb2, control_pb2_grpc
from tests.conformance.helpers import RPC_TIMEOUT_S, rpc_error
from tests.support.engines import EngineUnderTest

pytestmark = pytest.mark.timeout(120)

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server_info(control_stub: control_pb2_grpc.ControlStub) -> control_pb2.ServerInfo:
    reply: control_pb2.ServerInfo = control_stub.GetServerInfo(
        control_pb2.GetServerInfoRequest(), timeout=RPC_TIMEOUT_S
    )
    return reply


@pytest.fixture(scope="module")
def model_info(control_stub: control_pb2_grpc.ControlStub) -> control_pb2.ModelInfo:
    reply: control_pb2.ModelInfo = control_stub.GetModelInfo(
        control_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S
    )
    return reply


def test_server_identity(server_info: control_pb2.ServerInfo) -> None:
    assert server_info.api_version == "vllm"
    assert server_info.engine_version.strip()
    assert server_info.instance_id.strip()


def test_parallelism_covers_the_whole_group(
    server_info: control_pb2.ServerInfo, engine: EngineUnderTest
) -> None:
    parallelism = server_info.parallelism
    assert parallelism.data_parallel_size == engine.dp_size
    assert parallelism.data_parallel_rank == 0
    # vLLM reports the local count explicitly, never the "0 = whole group" shorthand.
    assert parallelism.data_parallel_size_local == engine.dp_size
    assert parallelism.tensor_parallel_size == 1
    assert parallelism.pipeline_parallel_size == 1


def test_kv_geometry(server_info: control_pb2.ServerInfo, engine: EngineUnderTest) -> None:
    assert server_info.kv_block_size == engine.block_size
    assert server_info.HasField("effective_attention_block_size")
    assert server_info.effective_attention_block_size == engine.block_size
    assert server_info.total_kv_blocks > 0
    assert server_info.total_kv_blocks // engine.dp_size > 0


def test_limits(server_info: control_pb2.ServerInfo) -> None:
    assert server_info.max_model_len == MAX_MODEL_LEN
    assert server_info.max_running_requests > 0
    assert server_info.max_batched_tokens > 0


def test_model_info(model_info: control_pb2.ModelInfo, engine: EngineUnderTest) -> None:
    assert model_info.served_model_name == engine.served_model_name
    assert model_info.model_id.strip()
    assert list(model_info.served_model_aliases) == []
    assert model_info.supports_token_ids_input
    assert model_info.supports_text_input
    assert not model_info.supports_lora


def test_kv_event_sources_one_per_rank(
    kv_sources: list[control_pb2.KvEventSource], engine: EngineUnderTest
) -> None:
    assert engine.kv_events_base_port is not None
    assert engine.kv_replay_base_port is not None
    assert len(kv_sources) == engine.dp_size
    by_rank = {}
    for source in kv_sources:
        assert source.HasField("data_parallel_rank")
        by_rank[source.data_parallel_rank] = source
    assert sorted(by_rank) == list(range(engine.dp_size))
    for rank, source in by_rank.items():
        assert source.transport == "zmq"
        assert source.encoding == "msgpack"
        assert source.endpoint.startswith("tcp://")
        assert source.endpoint.endswith(f":{engine.kv_events_base_port + rank}")
        assert source.replay_endpoint.startswith("tcp://")
        assert source.replay_endpoint.endswith(f":{engine.kv_replay_base_port + rank}")
    assert len({source.topic for source in kv_sources}) == 1


def test_list_loras_without_lora_support(control_stub: control_pb2_grpc.ControlStub) -> None:
    """SPEC.md says LoRA-disabled calls fail FAILED_PRECONDITION; ListLoras is one of them."""
    error = rpc_error(
        lambda: control_stub.ListLoras(control_pb2.ListLorasRequest(), timeout=RPC_TIMEOUT_S)
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "LoRA" in (error.details() or "")
