"""Import a script of ``bench/`` by its file name, as the bench's own tests need to."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"
# The scripts import their shared helpers (``peers``) as the scripts' own directory allows;
# appended, it never shadows an installed module.
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module, registered under ``name`` (dataclasses look it up)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
