"""bench/prefix_ceiling.py: the ceiling a perfect cache reaches, and vLLM's counters as read
from a Prometheus exposition like real vLLM 0.32's (one label set per engine)."""

from __future__ import annotations

import pytest

from tests.bench.load import bench_module

prefix_ceiling = bench_module("prefix_ceiling")
CacheCounters = prefix_ceiling.CacheCounters
ceiling = prefix_ceiling.ceiling
parse_counters = prefix_ceiling.parse_counters

BLOCK = 4


def test_a_repeated_prefix_hits_its_full_blocks_only() -> None:
    system = list(range(10, 18))  # two full blocks
    first = [*system, 1, 2, 3]
    second = [*system, 7, 8, 9, 6, 5]
    result = ceiling([first, second], BLOCK)
    assert result.queries == len(first) + len(second)
    # The second prompt finds both system blocks; its third block differs, its tail is partial.
    assert result.hits == 8


def test_the_last_token_is_always_computed() -> None:
    prompt = list(range(20, 28))  # exactly two blocks
    result = ceiling([prompt, prompt], BLOCK)
    # The repeat may hit only the blocks before its last token: one of two.
    assert result.hits == BLOCK


def test_a_block_hits_only_behind_the_same_prefix() -> None:
    shared_block = [5, 6, 7, 8]
    result = ceiling([[1, 2, 3, 4, *shared_block, 0], [9, 9, 9, 9, *shared_block, 0]], BLOCK)
    assert result.hits == 0


def test_a_growing_conversation_hits_its_whole_history() -> None:
    turns = [list(range(100, 100 + 4 * n + 2)) for n in (2, 3, 4)]
    result = ceiling(turns, BLOCK)
    # Turn 2 finds 2 blocks of turn 1; turn 3 finds 3 (the fourth was never sent whole).
    assert result.hits == (2 + 3) * BLOCK
    assert result.hit_rate == pytest.approx(20 / (10 + 14 + 18))


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        ceiling([[1]], 0)


EXPOSITION = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 800.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 160.0
# HELP vllm:num_requests_running Running requests.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_counters_sum_every_engine_and_subtract() -> None:
    after = parse_counters(EXPOSITION)
    assert after == CacheCounters(queries=2000.0, hits=800.0, by_engine=(1200.0, 800.0))
    run = after - CacheCounters(queries=1000.0, hits=300.0, by_engine=(700.0, 300.0))
    assert run.hit_rate == pytest.approx(0.5)
    assert run.busiest_share == pytest.approx(0.5)
    pooled = run + run
    assert pooled.hit_rate == pytest.approx(0.5)
    assert pooled.by_engine == (1000.0, 1000.0)
    assert CacheCounters().hit_rate is None
    assert CacheCounters().busiest_share is None


def test_an_exposition_without_the_counters_is_an_error() -> None:
    with pytest.raises(ValueError, match="vllm:prefix_cache_hits"):
        parse_counters(EXPOSITION.split("# HELP vllm:prefix_cache_hits")[0])
