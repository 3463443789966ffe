"""Where each named conversation went last: the router's memory of client affinity keys.

A client that names its conversation (OpenAI's ``prompt_cache_key``, a Responses chain, an
operator's session header) is telling the router which earlier requests it continues. The KV
events say the same once the engine has published them, but not in the moment between turns
of a fast agent, not for a gateway restarted beside a warm engine, and not for a prompt whose
earlier tokens were re-rendered. The table is an LRU bounded by entry count; entries expire.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class AffinityTable:
    """Key -> (slot, prompt tokens sent there, expiry), least recently used first."""

    __slots__ = ("_clock", "_entries", "capacity", "ttl")

    def __init__(
        self, capacity: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, tuple[int, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[int, int] | None:
        """The slot ``key`` last went to and the prompt tokens it sent, unless expired."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[2] <= self._clock():
            del self._entries[key]
            return None
        return entry[0], entry[1]

    def record(self, key: str, slot: int, prompt_tokens: int) -> None:
        entries = self._entries
        entries[key] = (slot, prompt_tokens, self._clock() + self.ttl)
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
