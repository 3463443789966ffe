"""bench/equal_load.py names the interpreter the gateway served under in its table's title."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from tests.bench.load import bench_module


def test_the_title_names_the_gateways_interpreter_and_its_version() -> None:
    named = bench_module("equal_load").interpreter(sys.executable)
    base = getattr(sys, "_base_executable", sys.executable)
    assert named == f"CPython {platform.python_version()} ({base})"
    assert Path(base).exists()
