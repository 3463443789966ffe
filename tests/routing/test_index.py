"""The indexes stay within their bounds and report the longest held prefix per rank."""

from __future__ import annotations

from rankgate.sidecar.routing.index import (
    DEVICE,
    OFFLOADED,
    EventIndex,
    PredictedIndex,
    medium_tier,
)


def test_longest_prefix_per_slot_and_tiers() -> None:
    index = EventIndex([10, 10, 10], [10, 10, 10])
    for n, key in enumerate([1, 2, 3]):
        index.store(0, DEVICE, f"a{n}", key)
    index.store(1, DEVICE, "b0", 1)
    index.store(2, OFFLOADED, "c0", 1)
    index.store(2, OFFLOADED, "c1", 2)
    found = index.match([1, 2, 3, 4])
    assert found.device == [3, 1, 0]
    assert found.any_tier == [3, 1, 2]
    assert index.match([]).device == [0, 0, 0]
    assert index.match([9, 1]).any_tier == [0, 0, 0]


def test_capacity_evicts_the_oldest_and_clear_forgets_one_rank() -> None:
    index = EventIndex([3, 3], [1, 1])
    for n in range(5):
        index.store(0, DEVICE, n, 100 + n)
    index.store(1, DEVICE, "x", 100)
    assert index.size(0) == 3
    assert index.evicted == 2
    assert index.match([100]).device == [0, 1]
    assert index.match([102, 103, 104]).device == [3, 0]
    index.clear(0)
    assert index.size(0) == 0
    assert index.match([100]).device == [0, 1]
    assert not index.remove(0, DEVICE, 3)
    assert index.remove(1, DEVICE, "x")
    assert index.device == {}


def test_two_block_ids_with_one_key_are_reference_counted() -> None:
    index = EventIndex([5], [5])
    index.store(0, DEVICE, "v1", 7)
    index.store(0, DEVICE, "v2", 7)
    index.remove(0, DEVICE, "v1")
    assert index.match([7]).device == [1]
    index.remove(0, DEVICE, "v2")
    assert index.match([7]).device == [0]


def test_prediction_is_an_lru_with_ttl() -> None:
    now = [0.0]
    predicted = PredictedIndex([3, 3], ttl=10.0, clock=lambda: now[0])
    predicted.record(0, [1, 2, 3])
    predicted.record(1, [1])
    assert predicted.match([1, 2, 3]) == [3, 1]
    predicted.record(0, [4])  # over capacity: the least recently used key (1) goes
    assert predicted.match([1, 2]) == [0, 1]
    now[0] = 5.0
    predicted.record(1, [1])
    now[0] = 12.0
    assert predicted.match([1]) == [0, 1]
    assert predicted.size(0) == 0


def test_a_prompt_longer_than_a_rank_keeps_its_last_keys_and_others_theirs() -> None:
    predicted = PredictedIndex([3, 3], ttl=10.0, clock=lambda: 0.0)
    predicted.record(1, [1, 2])
    predicted.record(0, [1, 2, 3, 4, 5])  # evicts its own 1 and 2 as it goes
    assert predicted.size(0) == 3
    assert predicted.match([1, 2]) == [0, 2]
    assert predicted.match([3, 4, 5]) == [3, 0]
    assert predicted.masks == {1: 0b10, 2: 0b10, 3: 0b01, 4: 0b01, 5: 0b01}
    predicted.record(0, [3, 6])  # 3 refreshed, 4 the least recent goes
    predicted.settle()
    assert predicted.masks == {1: 0b10, 2: 0b10, 3: 0b01, 5: 0b01, 6: 0b01}


def test_medium_tiers() -> None:
    assert medium_tier(None) == DEVICE
    assert medium_tier("GPU") == DEVICE
    assert medium_tier("CPU") == OFFLOADED
    assert medium_tier("disk") == OFFLOADED
