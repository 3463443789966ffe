"""The client suite's fixtures: its environment, and the clients' offline settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clients import harness


@pytest.fixture(scope="module")
def clients_bin() -> Path:
    return harness.clients_bin()


@pytest.fixture(scope="module")
def client_env(tmp_path_factory: pytest.TempPathFactory, clients_bin: Path) -> dict[str, str]:
    return harness.client_env(tmp_path_factory, clients_bin)
