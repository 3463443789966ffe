"""The optional compiled build: ``RANKGATE_COMPILE=1`` compiles the router's hot path with mypyc.

Everything else about the package is declared in ``pyproject.toml``; without the variable this
adds nothing and the wheel is pure Python. The modules listed are the ones a route decision
runs through (hashing a prompt, matching it against the KV index, pricing every rank); they are
strictly typed already, so mypyc compiles them as they are, and the pure-Python modules stay
the reference the test suite runs (``tests/routing/test_compiled.py`` runs the routing tests
against the compiled ones too). Compiling needs mypy and a C compiler in the build environment::

    RANKGATE_COMPILE=1 pip install --no-build-isolation .   # with mypy and setuptools installed
"""

from __future__ import annotations

import os

from setuptools import Extension, setup

COMPILED = [
    "rankgate/sidecar/routing/affinity.py",
    "rankgate/sidecar/routing/hashing.py",
    "rankgate/sidecar/routing/index.py",
    "rankgate/sidecar/routing/load.py",
    "rankgate/sidecar/routing/regret.py",
    "rankgate/sidecar/routing/policies/ranked.py",
    "rankgate/sidecar/routing/policies/kv.py",
    "rankgate/sidecar/routing/policies/load.py",
    "rankgate/sidecar/routing/policies/round_robin.py",
]


def compiled_modules() -> list[Extension]:
    if os.environ.get("RANKGATE_COMPILE") != "1":
        return []
    from mypyc.build import mypycify

    # The C compiler's optimisation level; the tests build at 0, which compiles in half the
    # time and runs the same code.
    level = os.environ.get("RANKGATE_COMPILE_OPT", "3")
    modules: list[Extension] = mypycify(COMPILED, opt_level=level)
    return modules


setup(ext_modules=compiled_modules())
