"""Gateways on loopback: one in front of the mock engine (real sidecar), one scripted."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from tests.app.scripted import ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.engines import EngineUnderTest


@pytest.fixture(scope="session")
def mock_gateway(mock_vllm: EngineUnderTest) -> Iterator[str]:
    settings = GatewaySettings(engine=mock_vllm.target, tokenizer=str(mock_vllm.tokenizer_dir))
    with serve_app(create_app(settings)) as url:
        yield url


@pytest.fixture(scope="session")
def scripted_engine() -> ScriptedEngine:
    info = scripted_info(TINY_TOKENIZER, tool_parser="hermes", reasoning="qwen3")
    return ScriptedEngine(info, TINY_TOKENIZER)


@pytest.fixture(scope="session")
def scripted_gateway(scripted_engine: ScriptedEngine) -> Iterator[str]:
    with serve_app(create_app(GatewaySettings(), engine=scripted_engine)) as url:
        yield url


@pytest.fixture
def scripted(scripted_engine: ScriptedEngine) -> Iterator[ScriptedEngine]:
    yield scripted_engine
    scripted_engine.outputs = ["Hello there."]
    scripted_engine.finish_reason = "stop"
    scripted_engine.fail_after = None
    scripted_engine.delay = 0.0
    scripted_engine.loras = ("my-lora",)


@pytest.fixture
def mock_client(mock_gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{mock_gateway}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def scripted_client(scripted_gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{scripted_gateway}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


@pytest.fixture
def mock_http(mock_gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mock_gateway, timeout=30) as client:
        yield client


@pytest.fixture
def scripted_http(scripted_gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=scripted_gateway, timeout=30) as client:
        yield client
