"""The optional compiled build (``RANKGATE_COMPILE=1``, ``setup.py``) routes as the pure one.

The router's hot modules are compiled with mypyc into a copy of the tree, and the routing
tests that drive them run there again. mypyc enforces every annotation at run time, so this
also checks that nothing reaches the router with a type other than the one it declares.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREE = ("rankgate", "tests", "pyproject.toml", "setup.py")
TESTS = (
    "tests/routing/test_policy.py",
    "tests/routing/test_regret.py",
    "tests/routing/test_production_shape.py",
    "tests/routing/test_affinity.py",
    "tests/routing/test_hashing.py",
    "tests/routing/test_index.py",
)
# Simulations the pure run already checks, on the routing code the narrower ones run
# compiled: minutes of agent traffic, and the widest engines (the same decisions per request,
# over more ranks).
_SHAPE = "tests/routing/test_production_shape.py::"
SKIP = (
    f"{_SHAPE}test_agent_sessions_keep_their_histories_and_their_share",
    *(
        f"{_SHAPE}{test}[{dp}]"
        for test in (
            "test_no_rank_takes_more_than_its_share_bound_under_skewed_traffic",
            "test_spreading_keeps_the_cache_hits_and_the_first_token_times",
        )
        for dp in (16, 32)
    ),
)

pytestmark = pytest.mark.timeout(600)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@pytest.mark.skipif(_compiler() is None, reason="no C compiler for mypyc")
def test_the_compiled_router_passes_the_routing_tests(tmp_path: Path) -> None:
    for name in TREE:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(
                source,
                tmp_path / name,
                symlinks=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.so"),
            )
        else:
            shutil.copy(source, tmp_path / name)
    env = {
        **os.environ,
        "RANKGATE_COMPILE": "1",
        "RANKGATE_COMPILE_OPT": "0",
        "PYTHONPATH": str(tmp_path),
    }
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]

    probe = (
        "import rankgate.sidecar.routing.index as index;"
        "from rankgate.sidecar.routing.policies import compiled;"
        "print(compiled(), index.__file__.endswith('.so'))"
    )
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.split() == ["True", "True"]

    tests = [name for name in TESTS if (tmp_path / name).exists()]
    skip = [arg for test in SKIP for arg in ("--deselect", test)]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    run = subprocess.run(
        [*command, *skip, *tests],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
