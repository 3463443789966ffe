"""Shared fixtures: the engines under test (mocker and real vLLM) and their gRPC stubs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.engines import EngineUnderTest
from tests.support.ports import free_port, free_port_range

ROOT = Path(__file__).resolve().parent.parent
TINY_TOKENIZER = ROOT / "mocker" / "assets" / "tiny-tokenizer"
CONFORMANCE_DP = 2
CONFORMANCE_BLOCK = 32


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[EngineUnderTest]:
    from tests.support.real_vllm import start_real_vllm

    with start_real_vllm(dp_size=CONFORMANCE_DP, block_size=CONFORMANCE_BLOCK) as server:
        yield EngineUnderTest(
            kind="real",
            target=server.target,
            dp_size=server.dp_size,
            block_size=server.block_size,
            served_model_name=server.served_model_name,
            tokenizer_dir=server.model_dir,
            kv_events_base_port=server.kv_events_base_port,
            kv_replay_base_port=server.kv_replay_base_port,
        )


@pytest.fixture(scope="session")
def mock_vllm() -> Iterator[EngineUnderTest]:
    from mocker.config import MockEngineConfig
    from mocker.testing import running_mock_engine

    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=CONFORMANCE_DP,
        block_size=CONFORMANCE_BLOCK,
        model="tiny-llama",
        tokenizer=str(TINY_TOKENIZER),
        kv_events_port=free_port_range(CONFORMANCE_DP),
        kv_replay_port=free_port_range(CONFORMANCE_DP),
        speed=0.0,
        max_model_len=512,
    )
    with running_mock_engine(config) as handle:
        yield EngineUnderTest(
            kind="mock",
            target=handle.target,
            dp_size=config.dp_size,
            block_size=config.block_size,
            served_model_name=config.model,
            tokenizer_dir=TINY_TOKENIZER,
            kv_events_base_port=config.kv_events_port,
            kv_replay_base_port=config.kv_replay_port,
            mock=handle,
        )


@pytest.fixture(
    scope="session",
    params=["mock", pytest.param("real", marks=pytest.mark.real_vllm)],
)
def engine(request: pytest.FixtureRequest) -> EngineUnderTest:
    """Each conformance test runs once per engine: the mocker and real vLLM (DP=2)."""
    name = "mock_vllm" if request.param == "mock" else "real_vllm"
    result: EngineUnderTest = request.getfixturevalue(name)
    return result


@pytest.fixture(scope="session")
def engine_channel(engine: EngineUnderTest) -> Iterator[grpc.Channel]:
    channel = grpc.insecure_channel(
        engine.target,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    yield channel
    channel.close()
