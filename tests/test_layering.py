"""Which packages may import which: data flows one way, no module needs one that needs it, the
product never depends on the mock's test handle, and nothing imports a part by a bare name that
the installed wheel does not have.

Imports are read from the source (lazy ones inside functions included), so a boundary holds
whether or not the import ever runs in a test.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "rankgate"
PACKAGE = ROOT / NAMESPACE
PARTS = ("app", "sidecar", "multimodal", "mocker", "wire")
# Only tests and benches start the mock through its test handle.
TEST_ONLY = ("tests.support.mock_engine",)
# Lower layers never reach up; a package's rule covers its subpackages. The wire code is the
# floor both ends of the gRPC contract stand on; the mock engine is a peer of the sidecar, not
# a user of it. Inside ``app``, the tokenizer and the output parsers sit below both preparing a
# request and answering it, and neither of those two reaches into the other.
NEVER = {
    "rankgate.wire": ("rankgate.app", "rankgate.sidecar", "rankgate.multimodal", "rankgate.mocker"),
    "rankgate.sidecar": ("rankgate.app", "rankgate.mocker"),
    "rankgate.multimodal": ("rankgate.app", "rankgate.sidecar.engine", "rankgate.mocker"),
    "rankgate.mocker": ("rankgate.app", "rankgate.sidecar", "rankgate.multimodal"),
    "rankgate.app.tokens": (
        "rankgate.app.prepare",
        "rankgate.app.respond",
        "rankgate.app.routes",
        "rankgate.app.parsers",
    ),
    "rankgate.app.parsers": ("rankgate.app.prepare", "rankgate.app.respond", "rankgate.app.routes"),
    "rankgate.app.prepare": ("rankgate.app.respond", "rankgate.app.routes"),
    "rankgate.app.respond": ("rankgate.app.prepare", "rankgate.app.routes"),
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _reaches(name: str, target: str) -> bool:
    return name == target or name.startswith(target + ".")


def product_modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if "proto" not in path.parts)


def test_imports_are_read_from_source(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "import os.path\nfrom rankgate.mocker import config\n"
        "def later():\n    from tests.support.mock_engine import running_mock_engine\n"
    )
    names = imports_of(module)
    expected = {
        "rankgate.mocker.config",
        "tests.support.mock_engine",
        "tests.support.mock_engine.running_mock_engine",
    }
    assert {"os.path", *expected} <= names
    assert any(_reaches(name, "tests.support.mock_engine") for name in names)


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_product_modules_keep_their_layer(path: Path) -> None:
    name = _module_name(path)
    forbidden = TEST_ONLY + tuple(
        target for layer, targets in NEVER.items() if _reaches(name, layer) for target in targets
    )
    wrong = sorted(
        name for name in imports_of(path) for target in forbidden if _reaches(name, target)
    )
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _related(a: str, b: str) -> bool:
    """A package and its own submodules (its ``__init__`` gathering them) are one unit."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in product_modules()}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps = set()
        for imported in imports_of(path):
            module = imported
            while module and module not in paths:
                module = module.rpartition(".")[0]
            if module and module != name and not _related(module, name):
                deps.add(module)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for node in graph:
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    """Type-only and lazy imports count: each hides a circle a reader still has to follow."""
    assert cycles(import_graph()) == []


def python_files() -> list[Path]:
    tracked = [ROOT / top for top in (NAMESPACE, "tests", "bench", "scripts")]
    return sorted(path for top in tracked for path in top.rglob("*.py"))


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_parts_are_imported_through_the_namespace(path: Path) -> None:
    """``app`` alone imports here (the checkout is on the path) but not from the wheel, and a
    module imported under both names would exist twice, with two copies of its state."""
    bare = sorted(name for name in imports_of(path) if name.partition(".")[0] in PARTS)
    assert not bare, f"{path.relative_to(ROOT)} imports {bare}; use rankgate.{bare[0]}"
