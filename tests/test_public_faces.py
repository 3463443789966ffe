"""The sidecar's and the media package's public faces: ``app`` imports them only through
``rankgate.sidecar`` and ``rankgate.multimodal`` and only names in their ``__all__``, so the
modules behind the faces can move without touching ``app``."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_layering import ROOT

FACES = ("rankgate.sidecar", "rankgate.multimodal")


def _app_modules() -> list[Path]:
    return sorted((ROOT / "rankgate" / "app").rglob("*.py"))


def _from_imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
    return found


@pytest.mark.parametrize("face", FACES)
def test_every_exported_name_resolves(face: str) -> None:
    module = importlib.import_module(face)
    assert module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    with pytest.raises(AttributeError):
        _ = module.not_exported


def test_the_sidecar_face_is_a_plain_module() -> None:
    """Every exported name is bound when the package loads: no lazy ``__getattr__`` to keep
    in step with ``__all__``. (The media package loads its names on first use, so that a
    decoder process imports Pillow and FFmpeg and nothing of the gateway.)"""
    module = importlib.import_module("rankgate.sidecar")
    assert not hasattr(module, "__getattr__")
    assert set(module.__all__) <= set(vars(module))


def _past_the_faces(path: Path) -> list[str]:
    wrong = []
    for module, names in _from_imports(path):
        for face in FACES:
            if module.startswith(face + "."):
                wrong.append(module)
            elif module == face:
                exported = importlib.import_module(face).__all__
                wrong.extend(f"{face}.{name}" for name in names if name not in exported)
    return wrong


@pytest.mark.parametrize("path", _app_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_app_imports_only_the_faces(path: Path) -> None:
    wrong = _past_the_faces(path)
    assert not wrong, f"{path.relative_to(ROOT)} reaches past the public face: {wrong}"


def test_a_private_import_is_caught(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "from rankgate.sidecar import Sidecar, _private\n"
        "def later():\n    import rankgate.multimodal.fetch\n"
    )
    assert _past_the_faces(module) == ["rankgate.sidecar._private", "rankgate.multimodal.fetch"]


def test_the_wire_code_loads_alone() -> None:
    """The HTTP/2 core and gRPC framing load without grpcio or anything else of Rankgate's."""
    probe = (
        "import sys, rankgate.wire.h2.connection, rankgate.wire.grpc_frame\n"
        "loaded = [m for m in sys.modules if m == 'grpc' or m.startswith('rankgate.')\n"
        "          and not m.startswith('rankgate.wire')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=ROOT, timeout=60)


def test_the_mock_engine_loads_without_the_sidecar() -> None:
    probe = (
        "import sys, rankgate.mocker.server\n"
        "loaded = [m for m in sys.modules if m.startswith(('rankgate.sidecar', 'rankgate.app'))]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=ROOT, timeout=60)
