"""bench/routing_simulation.py: its table, and variants parsed into routing configs."""

from __future__ import annotations

import sys

import pytest

from tests.bench.load import bench_module

routing_simulation = bench_module("routing_simulation")


def test_a_variant_names_routing_fields() -> None:
    name, config = routing_simulation._variant("wide=share_weight=0,share_slack=2")
    assert name == "wide"
    assert (config.share_weight, config.share_slack) == (0.0, 2.0)


def test_the_table_has_a_row_per_target(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["routing_simulation", "--dp", "2", "--load", "0.5", "--seconds", "5", "--seeds", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--variant", "noshare=share_weight=0", "--markdown"])
    routing_simulation.main()
    table = capsys.readouterr().out.split("Routing on the simulated engine")[1]
    rows = [line for line in table.splitlines() if line.startswith("| 2 |")]
    targets = [row.split(" | ")[3] for row in rows]
    assert targets == [
        "rankgate kv",
        "rankgate noshare",
        "longest prefix (vllm-router kv_aware)",
        "round robin",
    ]


def test_a_condition_prints_its_bounds_and_the_gap_closed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["routing_simulation", "--dp", "2", "--load", "0.5", "--seconds", "5", "--seeds", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--condition", "slow", "--per-rank", "--markdown"])
    routing_simulation.main()
    out = capsys.readouterr().out
    table = out.split("Routing on the simulated engine")[1].split("Where the TTFT went")[0]
    head = next(line for line in table.splitlines() if line.startswith("| DP |"))
    assert "ceiling hit" in head
    assert "gap closed TTFT / hit" in head
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| 2 |")]
    assert [row[2] for row in rows] == ["slow rank"] * 3
    assert rows[-1][-4] == "0% / 0%"  # round robin closes none of its own gap
    ranks = [line for line in out.split("Where the TTFT went")[1].splitlines() if "| 2 |" in line]
    assert {line.split(" | ")[3] for line in ranks} == {"0", "1"}
