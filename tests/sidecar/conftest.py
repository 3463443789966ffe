"""Fixtures for the sidecar tests: a purpose-built fake vLLM and a started Sidecar on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest_asyncio

from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.engine import Sidecar
from tests.sidecar.fake_vllm import FakeServer, FakeVllm
from tests.sidecar.routers import FixedRouter

StartSidecar = Callable[..., Awaitable[Sidecar]]


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer(FakeVllm())
    await server.start()
    yield server
    await server.stop()


@pytest_asyncio.fixture
async def start_sidecar(fake: FakeServer) -> AsyncIterator[StartSidecar]:
    """Start a Sidecar against the fake; every sidecar started here is closed afterwards."""
    started: list[Sidecar] = []

    async def start(router: Any = None, **config: Any) -> Sidecar:
        settings: dict[str, Any] = {
            "endpoint": fake.target,
            "startup_timeout": 5.0,
            "retry_interval": 0.05,
            "health_interval": 0.05,
        }
        settings.update(config)
        sidecar = Sidecar(SidecarConfig(**settings), router or FixedRouter())
        started.append(sidecar)
        await sidecar.start()
        return sidecar

    yield start
    for sidecar in started:
        await sidecar.close()
