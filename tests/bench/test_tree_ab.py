"""bench/tree_ab.py runs end to end: a line per run, each tree's median, from the tree given."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.bench.load import BENCH

pytestmark = pytest.mark.timeout(240)


def test_it_serves_each_tree_and_prints_its_median() -> None:
    """A tree with extra serve arguments, and the bare HTTP server's floor."""
    tree = f"{BENCH.parent}+--route-regret-keys,0"
    argv = [
        sys.executable, str(BENCH / "tree_ab.py"), tree, "floor", "--rounds", "2", "--rate",
        "100", "--seconds", "0.5", "--clients", "2", "--tokenizer", "tiny",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for spec in (tree, "floor"):
        runs = re.findall(rf"round (\d) {re.escape(spec)}: ([\d.]+) ms a request", done.stdout)
        assert [round_ for round_, _ in runs] == ["0", "1"], done.stdout
        # CPU comes from /proc's 10 ms ticks: over these few requests it may read 0.
        assert all(float(ms) >= 0 for _, ms in runs)
        assert re.search(rf"  {re.escape(spec)}: [\d.]+ \(user [\d.]+\) \[", done.stdout)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_poisson_arrivals_of_unique_prompts() -> None:
    """The open-loop client (``bench/open_loop.mjs``) in place of h2load, every prompt new."""
    argv = [
        sys.executable, str(BENCH / "tree_ab.py"), str(BENCH.parent), "--rounds", "1",
        "--rate", "100", "--seconds", "0.5", "--clients", "2", "--tokenizer", "tiny",
        "--arrivals", "poisson", "--unique",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(rf"round 0 {re.escape(str(BENCH.parent))}: [\d.]+ ms a request", done.stdout)
