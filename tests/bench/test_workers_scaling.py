"""bench/workers_scaling.py: how its figures are formed from the runs (pairs of sequential
runs, and the sums of interleaved turns), since docs/benchmarks.md quotes them."""

from __future__ import annotations

import argparse

import pytest

from tests.bench.load import bench_module

workers_scaling = bench_module("workers_scaling")
Drive = workers_scaling.Drive


def _result(workers: int, cpu_per_request_us: float) -> object:
    return Drive([0.001] * 100, 0, 1.0, cpu_per_request_us * 100 / 1e6, 0.1).result(workers, 0)


def test_each_run_is_compared_with_the_one_worker_run_before_it() -> None:
    runs = [_result(2, 999), _result(1, 100), _result(2, 120), _result(1, 200), _result(2, 210)]
    ratios = workers_scaling.pair_ratios(runs)
    # The leading two-worker run has no one-worker run before it, so it forms no pair.
    assert ratios == pytest.approx([1.2, 1.05])


def test_turns_add_up_to_the_count_s_totals() -> None:
    first = Drive([0.002] * 10, 1, 2.0, 0.010, 0.5)
    second = Drive([0.004] * 30, 0, 2.0, 0.030, 0.5)
    total = (first + second).result(2, idle=0.0125)
    assert total.requests == 40
    assert total.errors == 1
    assert total.cpu_per_request_us == pytest.approx(1000)
    assert total.gateway_cores == pytest.approx(0.01)
    assert total.p50_ms == pytest.approx(4)
    assert total.idle_ms_per_s == pytest.approx(12.5)


def test_pinning_takes_two_cpu_lists() -> None:
    assert workers_scaling._cpu_split("0:1,2") == ({0}, {1, 2})
    with pytest.raises(argparse.ArgumentTypeError):
        workers_scaling._cpu_split("0:one")
