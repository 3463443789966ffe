"""bench/offload_threads.py runs end to end: one line of figures per pool size and order."""

from __future__ import annotations

import subprocess
import sys

from tests.bench.load import BENCH


def test_it_prints_a_row_per_pool_size_and_order() -> None:
    argv = [
        sys.executable, str(BENCH / "offload_threads.py"), "--tokenizer", "tiny",
        "--threads", "1", "2", "--clients", "2", "--kb", "8", "--medium-kb", "2",
        "--seconds", "0.3", "--cpus", "0",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rows = [
        row
        for row in (line.split() for line in done.stdout.splitlines())
        if len(row) == 8 and row[1] in ("fifo", "finish")
    ]
    assert [(row[0], row[1]) for row in rows] == [
        ("1", "fifo"),
        ("1", "finish"),
        ("2", "fifo"),
        ("2", "finish"),
    ]
    for row in rows:
        encoded, late_p50, late_p99, late_max, medium_p50, medium_p99 = map(float, row[2:])
        assert encoded > 0
        assert late_p50 <= late_p99 <= late_max
        assert 0 < medium_p50 <= medium_p99
