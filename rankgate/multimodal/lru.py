"""A least-recently-used map bounded by a total cost, usually bytes.

Every cache in this package goes through it so that none can grow without a limit: the fetch
cache charges each entry its body size, the decode memo the bytes it keeps, the learned token
counts one unit per image.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """Evicts least recently used entries until the summed cost fits ``capacity``.

    An entry costing more than the whole capacity is not stored at all, so one huge value can
    never flush everything else.
    """

    __slots__ = ("_capacity", "_cost", "_entries", "_total")

    def __init__(self, capacity: int, cost: Callable[[V], int] = lambda _value: 1) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self._capacity = capacity
        self._cost = cost
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def total_cost(self) -> int:
        return self._total

    @property
    def capacity(self) -> int:
        return self._capacity

    def get(self, key: K) -> V | None:
        item = self._entries.get(key)
        if item is None:
            return None
        self._entries.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V) -> bool:
        """Store ``value``; returns False when it alone exceeds the capacity."""
        cost = self._cost(value)
        self.pop(key)
        if cost > self._capacity:
            return False
        self._entries[key] = (value, cost)
        self._total += cost
        while self._total > self._capacity:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._total -= evicted
        return True

    def pop(self, key: K) -> V | None:
        item = self._entries.pop(key, None)
        if item is None:
            return None
        self._total -= item[1]
        return item[0]

    def clear(self) -> None:
        self._entries.clear()
        self._total = 0
