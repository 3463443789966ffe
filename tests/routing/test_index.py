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
    assert index.remove(1, DEVICE, "x") is not None
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
    predicted = PredictedIndex([3, 3], ttl=10.0, clock=lambda: now[0], stride=1)
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


def test_expired_predictions_go_within_a_64th_of_their_ttl() -> None:
    """Reads walk the slots for expired entries only once one is due, and then not again for
    a 64th of the ttl: an entry counts until its ttl, and never past ttl * (1 + 1/64)."""
    now = [0.0]
    predicted = PredictedIndex([8, 8, 8], ttl=64.0, clock=lambda: now[0], stride=1)
    predicted.record(0, [1])
    now[0] = 0.5
    predicted.record(1, [1])
    now[0] = 40.0
    predicted.record(2, [1])
    now[0] = 63.9
    assert predicted.match([1]) == [1, 1, 1]
    now[0] = 64.0
    assert predicted.match([1]) == [0, 1, 1]
    now[0] = 65.0
    assert predicted.match([1]) == [0, 0, 1]
    assert predicted.size(1) == 0
    now[0] = 103.9
    assert predicted.match([1]) == [0, 0, 1]
    now[0] = 104.0
    assert predicted.match([1]) == [0, 0, 0]
    assert predicted.masks == {}
    predicted.record(0, [2])
    now[0] = 167.9
    assert predicted.match([2]) == [1, 0, 0]
    now[0] = 168.0
    assert predicted.match([2]) == [0, 0, 0]


def test_a_prompt_longer_than_a_rank_keeps_its_last_keys_and_others_theirs() -> None:
    predicted = PredictedIndex([3, 3], ttl=10.0, clock=lambda: 0.0, stride=1)
    predicted.record(1, [1, 2])
    predicted.record(0, [1, 2, 3, 4, 5])  # evicts its own 1 and 2 as it goes
    assert predicted.size(0) == 3
    assert predicted.match([1, 2]) == [0, 2]
    assert predicted.match([3, 4, 5]) == [3, 0]
    assert predicted.masks == {1: 0b10, 2: 0b10, 3: 0b01, 4: 0b01, 5: 0b01}
    predicted.record(0, [3, 6])  # 3 refreshed, 4 the least recent goes
    predicted.settle()
    assert predicted.masks == {1: 0b10, 2: 0b10, 3: 0b01, 5: 0b01, 6: 0b01}


def test_predictions_keep_one_key_a_stride_and_every_key_of_a_prompts_tail() -> None:
    predicted = PredictedIndex([64, 64], ttl=10.0, clock=lambda: 0.0, stride=4, dense=0)
    prompt = list(range(100, 110))  # ten chained keys: checkpoint 103, then its last four
    predicted.record(1, prompt)
    assert predicted.size(1) == 10
    assert predicted.masks == {103: 0b10, 106: 0b10, 107: 0b10, 108: 0b10, 109: 0b10}
    # The whole prompt, and the next turn that extends it, to the block.
    assert predicted.match(prompt) == [0, 10]
    assert predicted.match([*prompt, 110, 111, 112, 113, 114]) == [0, 10]
    assert predicted.match([*prompt[:7], 300, 301, 302, 303]) == [0, 7]
    # One that leaves its body: down to the checkpoint before.
    assert predicted.match([*prompt[:6], 300, 301, 302, 303]) == [0, 4]
    assert predicted.match(list(range(300, 310))) == [0, 0]
    # A prompt no longer than the stride is all tail.
    predicted.record(0, prompt[:3])
    assert predicted.match(prompt) == [3, 10]
    assert predicted.match(prompt[:2]) == [2, 0]


def test_the_first_blocks_of_a_prompt_stay_exact() -> None:
    predicted = PredictedIndex([64, 64], ttl=10.0, clock=lambda: 0.0, stride=4, dense=4)
    prompt = list(range(100, 114))  # 100-103 every key, checkpoint 107, tail 110-113
    predicted.record(0, prompt)
    assert predicted.size(0) == 14
    assert sorted(predicted.masks) == [100, 101, 102, 103, 107, 110, 111, 112, 113]
    assert predicted.match([*prompt[:3], 300, 301]) == [3, 0]
    assert predicted.match([*prompt[:6], 300, 301, 302, 303]) == [4, 0]
    assert predicted.match([*prompt[:12], 300, 301, 302]) == [12, 0]
    assert predicted.match(prompt) == [14, 0]
    # A key missing from the exact part ends the match there, as a missing block would.
    predicted.record(1, [100, 999, 102, 103])
    assert predicted.match(prompt)[1] == 1


def test_each_entry_weighs_the_blocks_it_stands_for_against_the_capacity() -> None:
    predicted = PredictedIndex([8, 8], ttl=10.0, clock=lambda: 0.0, stride=4, dense=0)
    predicted.record(0, list(range(100, 116)))  # checkpoints of four blocks, then a tail of 4
    assert predicted.size(0) == 8
    assert predicted.masks == {111: 1, 112: 1, 113: 1, 114: 1, 115: 1}
    assert predicted.match(list(range(100, 116))) == [0, 0]  # its prefix's entries are gone


def test_medium_tiers() -> None:
    assert medium_tier(None) == DEVICE
    assert medium_tier("GPU") == DEVICE
    assert medium_tier("CPU") == OFFLOADED
    assert medium_tier("disk") == OFFLOADED
