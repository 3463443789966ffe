"""bench/equal_load.py names the interpreter the gateway served under in its table's title, and
takes a saturation run in which vllm-router failed again rather than stopping."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import pytest

from tests.bench.load import bench_module


def test_the_title_names_the_gateways_interpreter_and_its_version() -> None:
    named = bench_module("equal_load").interpreter(sys.executable)
    base = getattr(sys, "_base_executable", sys.executable)
    assert named == f"CPython {platform.python_version()} ({base})"
    assert Path(base).exists()


H2LOAD_FAILED = """finished in 18.92s, 158.59 req/s, 559.56KB/s
requests: 3000 total, 3000 started, 3000 done, 348 succeeded, 2652 failed, 0 errored, 0 timeout
status codes: 348 2xx, 0 3xx, 0 4xx, 2652 5xx
"""


def test_a_failed_load_run_names_its_status_codes() -> None:
    failure = bench_module("peers_overhead").LoadFailed("vllm-router kv_aware", H2LOAD_FAILED)
    assert failure.statuses == "status codes: 348 2xx, 0 3xx, 0 4xx, 2652 5xx"
    assert "vllm-router kv_aware" in str(failure)
    assert bench_module("peers_overhead").LoadFailed("g", "").statuses == "no status codes"


def test_a_failed_saturation_run_is_taken_again_and_the_last_failure_raised(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    equal_load = bench_module("equal_load")
    failed = bench_module("peers_overhead").LoadFailed("vllm-router", H2LOAD_FAILED)
    outcomes: list[object] = [failed, failed, 4321.0]

    def saturate(*_: object) -> float:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, float)
        return outcome

    monkeypatch.setattr(equal_load, "_saturate", saturate)
    args = argparse.Namespace(stream_clients=64, clients=16)
    assert equal_load.saturation_rate(None, {"stream": True}, args) == 4321.0
    said = (
        "vllm-router failed its saturation run (status codes: 348 2xx, 0 3xx, 0 4xx, 2652 5xx); "
        "again with a fresh one"
    )
    assert capsys.readouterr().out.splitlines() == [said, said]

    outcomes[:] = [failed] * equal_load.SATURATION_TRIES
    with pytest.raises(bench_module("peers_overhead").LoadFailed):
        equal_load.saturation_rate(None, {"stream": True}, args)
    assert outcomes == []
