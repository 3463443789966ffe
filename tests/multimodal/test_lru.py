from __future__ import annotations

import pytest

from rankgate.multimodal.lru import BoundedLRU


def test_evicts_least_recently_used_by_cost() -> None:
    lru: BoundedLRU[str, bytes] = BoundedLRU(10, cost=len)
    lru.put("a", b"aaaa")
    lru.put("b", b"bbbb")
    assert lru.get("a") == b"aaaa"
    lru.put("c", b"cccc")
    assert "b" not in lru
    assert ("a" in lru, "c" in lru, lru.total_cost) == (True, True, 8)


def test_oversize_value_is_not_stored_and_flushes_nothing() -> None:
    lru: BoundedLRU[str, bytes] = BoundedLRU(4, cost=len)
    lru.put("a", b"aa")
    assert lru.put("big", b"xxxxx") is False
    assert ("big" in lru, lru.get("a")) == (False, b"aa")


def test_replacing_a_key_recounts_its_cost() -> None:
    lru: BoundedLRU[str, bytes] = BoundedLRU(10, cost=len)
    lru.put("a", b"aaaaaa")
    lru.put("a", b"a")
    assert (lru.total_cost, len(lru)) == (1, 1)
    assert lru.pop("a") == b"a"
    assert lru.pop("a") is None
    assert lru.total_cost == 0


def test_count_bounded_by_default() -> None:
    lru: BoundedLRU[int, int] = BoundedLRU(3)
    for i in range(10):
        lru.put(i, i)
    assert [lru.get(i) for i in range(10)] == [None] * 7 + [7, 8, 9]
    with pytest.raises(ValueError, match="capacity"):
        BoundedLRU(-1)
