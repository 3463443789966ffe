"""bench/tree_ab.py runs end to end: a line per run, each tree's median, from the tree given."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.bench.load import BENCH

pytestmark = pytest.mark.timeout(240)


def test_it_serves_each_tree_and_prints_its_median() -> None:
    root = BENCH.parent
    argv = [
        sys.executable, str(BENCH / "tree_ab.py"), str(root), "--rounds", "2", "--rate", "100",
        "--seconds", "0.5", "--clients", "2", "--tokenizer", "tiny",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = re.findall(rf"round (\d) {re.escape(str(root))}: ([\d.]+) ms a request", done.stdout)
    assert [round_ for round_, _ in runs] == ["0", "1"]
    # CPU comes from /proc's 10 ms ticks: over these few requests it may read 0.
    assert all(float(ms) >= 0 for _, ms in runs)
    assert re.search(rf"  {re.escape(str(root))}: [\d.]+ \(user [\d.]+\) \[", done.stdout)
