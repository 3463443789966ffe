"""Smoke test of bench/peers_overhead.py: tiny counts, Rankgate alone, against the mocker.

Figures are never asserted (speed is the bench's job, not the suite's); the test proves the
script starts the engine (at zero latency, then paced) and the gateway, drives every phase
through h2load and prints a complete row.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_overhead_bench_measures_rankgate() -> None:
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "bench" / "peers_overhead.py"), "--peers", "rankgate",
            "--requests", "40", "--streams", "16", "--latency-requests", "10",
            "--concurrency", "4", "--short-tokens", "4", "--long-tokens", "16",
            "--step-ms", "1", "--tokenizer", "tiny", "--rounds", "2", "--markdown",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| rankgate")]
    assert len(rows) == 1, done.stdout
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells[0] == "rankgate --policy kv"
    numbers = [float(cell) for cell in cells[1:]]
    assert len(numbers) == 10
    cpu_per_request, requests_per_second, core, load_side, _, paced_core, p50, p99 = numbers[:8]
    assert cpu_per_request > 0
    assert requests_per_second > 0
    # Utilisations come from /proc's 10 ms ticks: over these few requests they may read 0.
    assert min(core, load_side, paced_core) >= 0
    assert 0 < p50 <= p99
    assert re.search(r"\| \(engine direct, gRPC\) \|", done.stdout)
