from __future__ import annotations

from typing import Any

import pytest

from rankgate.sidecar.discovery import build_discovered, served_ranks
from rankgate.sidecar.errors import DiscoveryError
from rankgate.sidecar.types import RankCapacity
from rankgate.wire.proto.vllm import control_pb2


def model_info(**overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "model_id": "org/tiny",
        "served_model_name": "tiny",
        "served_model_aliases": ["tiny-b", "tiny-a"],
        "supports_text_input": True,
        "supports_token_ids_input": True,
        "supports_multimodal": True,
        "reasoning_parser": "qwen3",
    }
    fields.update(overrides)
    return control_pb2.ModelInfo(**fields)


def server_info(dp: tuple[int, int, int] = (2, 0, 0), **overrides: Any) -> Any:
    size, start, local = dp
    fields: dict[str, Any] = {
        "engine_version": "0.32.0",
        "api_version": "vllm",
        "instance_id": "abc",
        "parallelism": control_pb2.ParallelismInfo(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=size,
            data_parallel_rank=start,
            data_parallel_size_local=local,
        ),
        "max_model_len": 4096,
        "kv_block_size": 16,
        "total_kv_blocks": 1001,
        "max_running_requests": 128,
        "max_batched_tokens": 8192,
    }
    fields.update(overrides)
    return control_pb2.ServerInfo(**fields)


def test_valid_engine_description() -> None:
    found = build_discovered(model_info(model_id="  org/tiny "), server_info(), [], "h")
    info = found.info
    assert found.wire_model == "tiny"
    assert info.model_id == "org/tiny"
    assert info.aliases == ("tiny-a", "tiny-b")
    assert info.ranks == (0, 1)
    assert info.dp_size == 2
    assert info.block_size == 16
    # 1001 blocks over 2 ranks round down; running requests are already per rank.
    assert info.capacity == (RankCapacity(0, 500, 128), RankCapacity(1, 500, 128))
    assert info.kv_event_sources == ()
    assert info.reasoning_parser == "qwen3"


def test_effective_attention_block_size_wins() -> None:
    found = build_discovered(model_info(), server_info(effective_attention_block_size=64), [], "h")
    assert found.info.block_size == 64
    assert found.identity.block_size == 64


def test_operator_name_override_keeps_engine_name_as_alias() -> None:
    found = build_discovered(model_info(), server_info(), [], "h", served_model_name="public")
    assert found.info.served_model_name == "public"
    assert found.info.aliases == ("tiny", "tiny-a", "tiny-b")
    assert found.wire_model == "tiny"
    assert found.identity.served_model_name == "tiny"


@pytest.mark.parametrize(
    ("dp", "ranks"),
    [((2, 0, 0), (0, 1)), ((8, 0, 4), (0, 1, 2, 3)), ((8, 4, 4), (4, 5, 6, 7)), ((1, 0, 0), (0,))],
)
def test_dp_layouts(dp: tuple[int, int, int], ranks: tuple[int, ...]) -> None:
    assert served_ranks(server_info(dp).parallelism) == ranks


@pytest.mark.parametrize(
    ("dp", "message"),
    [
        ((0, 0, 0), "at least 1"),
        ((8, 4, 0), "must start at rank 0"),
        ((8, 0, 9), "outside the data-parallel group"),
        ((8, 4, 5), "outside the data-parallel group"),
    ],
)
def test_bad_dp_layouts(dp: tuple[int, int, int], message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        build_discovered(model_info(), server_info(dp), [], "h")


@pytest.mark.parametrize(
    ("model", "server", "message"),
    [
        ({}, {"api_version": "sglang"}, "api_version 'sglang'"),
        ({}, {"api_version": ""}, "api_version ''"),
        ({"model_id": "   "}, {}, "empty model_id"),
        ({"served_model_name": "\t"}, {}, "empty served_model_name"),
        ({"supports_token_ids_input": False}, {}, "token-id prompts"),
        ({}, {"kv_block_size": 0}, "block size of 0"),
        ({}, {"max_model_len": 0}, "max_model_len 0"),
        ({}, {"total_kv_blocks": 1}, "less than one block per rank"),
    ],
)
def test_validation_failures(model: dict[str, Any], server: dict[str, Any], message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        build_discovered(model_info(**model), server_info(**server), [], "h")


def test_unreported_capacity_stays_zero() -> None:
    found = build_discovered(
        model_info(), server_info(total_kv_blocks=0, max_running_requests=0), [], "h"
    )
    assert found.info.capacity == (RankCapacity(0, 0, 0), RankCapacity(1, 0, 0))


def test_identity_changes_name_each_field() -> None:
    before = build_discovered(model_info(), server_info(), [], "h").identity
    after = build_discovered(
        model_info(model_id="org/other", tool_call_parser="hermes"), server_info((4, 0, 0)), [], "h"
    ).identity
    changes = after.changes_from(before)
    assert "model_id: 'org/tiny' -> 'org/other'" in changes
    assert "tool_call_parser: '' -> 'hermes'" in changes
    assert "data_parallel_size: 2 -> 4" in changes
    assert "ranks: (0, 1) -> (0, 1, 2, 3)" in changes
    assert before.changes_from(before) == []


def test_alias_order_is_not_a_change() -> None:
    a = build_discovered(model_info(served_model_aliases=["x", "y"]), server_info(), [], "h")
    b = build_discovered(model_info(served_model_aliases=["y", "x"]), server_info(), [], "h")
    assert b.identity.changes_from(a.identity) == []


def test_kv_sources_are_validated_against_served_ranks() -> None:
    sources = [
        control_pb2.KvEventSource(transport="zmq", endpoint="tcp://*:7000", data_parallel_rank=4),
        control_pb2.KvEventSource(transport="zmq", endpoint="tcp://*:7001", data_parallel_rank=5),
    ]
    found = build_discovered(model_info(), server_info((8, 4, 2)), sources, "gpu-host")
    assert [s.endpoint for s in found.info.kv_event_sources] == [
        "tcp://gpu-host:7000",
        "tcp://gpu-host:7001",
    ]
