"""The house's promises, kept as tests: one real package and nothing else importable by a part's
bare name, small modules and functions, and a suite that waits for states instead of sleeping.

Each rule reads the source (the AST, or git's index), so it holds whether or not the code runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_layering import NAMESPACE, PACKAGE, PARTS, ROOT

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# What else the repository root holds that Python can import: the suite, the benches and the
# developer scripts (never installed) and the build script. Anything more would be a second
# name for product code.
DEVELOPMENT_NAMES = {"tests", "bench", "scripts", "setup"}
# Sleeps that stand for time itself, each with what it stands for: the latency a fake
# simulates, or a wait the real engine gives no state to replace.
TIMED_SLEEPS = {
    "tests/sidecar/fake_vllm.py": "a fake engine's time per token and a health check that stalls",
    "tests/multimodal/test_fetch.py": "a server trickling its body past the fetch's deadline",
    "tests/disagg/test_real_vllm_pd.py": (
        "vLLM publishes a finished request's token counters late and says nothing when they are "
        "complete: two reads a settling interval apart must agree"
    ),
}


def _product_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "proto" not in p.parts)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_nothing_in_the_repository_is_a_symlink() -> None:
    """A symlink is a text file on a checkout without them (Windows' default git), so the wheel
    built there would differ from this one."""
    staged = subprocess.run(
        ["git", "ls-files", "--stage"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    links = [line.split("\t", 1)[1] for line in staged.splitlines() if line.startswith("120000")]
    assert not links, f"symlinks in the repository: {links}"


def _top_level_names(files: list[str]) -> set[str]:
    """The names ``import`` finds at the root for these tracked files: a module, or a folder
    holding Python (a package, or a namespace package when it has no ``__init__.py``)."""
    names = set()
    for file in files:
        top, _, rest = file.partition("/")
        if not rest and top.endswith(".py"):
            names.add(top.removesuffix(".py"))
        elif rest.endswith(".py") and top.isidentifier():
            names.add(top)
    return names


def _tracked() -> list[str]:
    return subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()


def test_only_rankgate_is_a_product_name_at_the_root() -> None:
    assert _top_level_names(_tracked()) - DEVELOPMENT_NAMES == {NAMESPACE}
    probe = (
        "import importlib.util, sys\n"
        f"found = [n for n in {PARTS!r} if importlib.util.find_spec(n) is not None]\n"
        "assert not found, found\n"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True, timeout=60)


def test_the_root_names_are_found() -> None:
    files = ["pkg/mod.py", "data/table.csv", "tool.py", "README.md", "a-b/x.py"]
    assert _top_level_names(files) == {"pkg", "tool"}


@pytest.mark.parametrize("path", _product_modules(), ids=_rel)
def test_a_module_fits_its_bound(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_rel(path)}: {lines} lines; split it along a seam"


def long_functions(source: str) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append((node.name, length))
    return found


@pytest.mark.parametrize("path", _product_modules(), ids=_rel)
def test_functions_fit_their_bound(path: Path) -> None:
    assert not long_functions(path.read_text()), f"{_rel(path)}: over {MAX_FUNCTION_LINES} lines"


def test_a_long_function_is_found() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}") == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions("def g():\n    return 1\n") == []


def fixed_sleeps(source: str) -> list[int]:
    """Lines that sleep a non-zero constant: a literal, or a module-level name bound to one."""
    tree = ast.parse(source)
    constants = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def fixed(arg: ast.expr) -> bool:
        if isinstance(arg, ast.Constant):
            return arg.value not in (0, 0.0, None)
        if isinstance(arg, ast.UnaryOp | ast.BinOp):
            return all(
                fixed(child) for child in ast.iter_child_nodes(arg) if isinstance(child, ast.expr)
            )
        return isinstance(arg, ast.Name) and arg.id in constants

    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "sleep" and fixed(node.args[0]):
            lines.append(node.lineno)
    return lines


def _test_modules() -> list[Path]:
    here = ROOT / "tests"
    return sorted(p for p in here.rglob("*.py") if _rel(p) not in TIMED_SLEEPS)


@pytest.mark.parametrize("path", _test_modules(), ids=_rel)
def test_tests_wait_for_states_not_times(path: Path) -> None:
    lines = fixed_sleeps(path.read_text())
    assert not lines, (
        f"{_rel(path)} sleeps a fixed time at lines {lines}: wait for the state through "
        "tests.support.polling, an event or an injected clock"
    )


def test_a_fixed_sleep_is_found() -> None:
    source = (
        "import asyncio, time\nDELAY = 0.5\n"
        "time.sleep(1)\nawait_it = asyncio.sleep(DELAY)\ntime.sleep(0)\ntime.sleep(interval)\n"
    )
    assert fixed_sleeps(source) == [3, 4]
