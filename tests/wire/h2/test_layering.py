"""Who may import the HTTP/2 core, and what it may import.

The core knows neither gRPC nor the gateway; the mock engine shares the core with the
gateway and nothing else of its transport, so the test double never runs on the product's
client code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "rankgate"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_core_imports_no_grpc_and_nothing_of_the_gateway() -> None:
    paths = sorted((PACKAGE / "wire" / "h2").glob("*.py"))
    assert paths
    for path in paths:
        for name in _imports(path):
            assert not name.startswith("grpc"), f"{path.name} imports {name}"
            if name.startswith("rankgate."):
                assert name.startswith("rankgate.wire.h2"), f"{path.name} imports {name}"


def test_the_mock_engine_takes_nothing_from_the_gateway() -> None:
    paths = sorted((PACKAGE / "mocker").rglob("*.py"))
    assert paths
    for path in paths:
        for name in _imports(path):
            wrong = name.startswith(("rankgate.sidecar", "rankgate.app"))
            assert not wrong, f"{path.relative_to(ROOT)} imports {name}"


def test_the_inference_client_speaks_no_grpcio() -> None:
    for module in ("http2.py", "inference_client.py"):
        names = _imports(PACKAGE / "sidecar" / module)
        assert not any(name == "grpc" or name.startswith("grpc.") for name in names), module
