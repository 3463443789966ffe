"""What each rank holds: an index fed by KV events and one predicted from our own decisions.

Both answer the same question, "how many leading blocks of this prompt does each rank hold?",
with one dictionary lookup per block whatever the number of ranks: a key maps to a bitmask of
the rank slots holding it. Slots are 0..n-1 in rank order (a frontend may serve ranks 4..7).

The event index has a single writer (the intake thread) and the route path only reads it with
``dict.get``, which is atomic under the GIL, so neither side takes a lock.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import msgspec

DEVICE = 0
OFFLOADED = 1
TIERS = (DEVICE, OFFLOADED)


def medium_tier(medium: object) -> int:
    """vLLM reports ``None`` or ``"GPU"`` for device memory; anything else is an offload tier."""
    if medium is None:
        return DEVICE
    if isinstance(medium, str) and medium.upper() in ("GPU", "DEVICE", "HBM", "XPU", "NPU"):
        return DEVICE
    return OFFLOADED


class PrefixMatch(msgspec.Struct, gc=False):
    """Per slot: leading blocks held on device, and leading blocks held on any tier."""

    device: list[int]
    any_tier: list[int]


def _record_drops(depths: list[int], dropped: int, depth: int) -> None:
    """Set ``depth`` for each slot in the mask ``dropped``. Depths start at 0 and each slot is
    recorded once, so a drop at the first block (most ranks of a wide engine, for most
    prompts) leaves nothing to write."""
    if not depth:
        return
    while dropped:
        low = dropped & -dropped
        depths[low.bit_length() - 1] = depth
        dropped ^= low


def match_masks(
    hashes: Sequence[int],
    slots: int,
    device: dict[int, int],
    offloaded: dict[int, int] | None,
) -> PrefixMatch:
    """Longest held prefix per slot, walking the prompt once."""
    full = (1 << slots) - 1
    dev_alive = full
    any_alive = full
    dev_depth = [0] * slots
    any_depth = [0] * slots
    get = device.get
    depth = 0
    if offloaded:
        off_get = offloaded.get
        for depth, key in enumerate(hashes):
            held = get(key, 0)
            now_dev = dev_alive & held
            if now_dev != dev_alive:
                _record_drops(dev_depth, dev_alive & ~now_dev, depth)
                dev_alive = now_dev
            now_any = any_alive & (held | off_get(key, 0))
            if now_any != any_alive:
                _record_drops(any_depth, any_alive & ~now_any, depth)
                any_alive = now_any
                if not any_alive:
                    break
        else:
            depth = len(hashes)
    else:
        for depth, key in enumerate(hashes):
            now = dev_alive & get(key, 0)
            if now != dev_alive:
                _record_drops(dev_depth, dev_alive & ~now, depth)
                dev_alive = now
                if not dev_alive:
                    break
        else:
            depth = len(hashes)
        any_alive = dev_alive
        any_depth = dev_depth
    _record_drops(dev_depth, dev_alive, depth)
    if any_depth is not dev_depth:
        _record_drops(any_depth, any_alive, depth)
    return PrefixMatch(device=dev_depth, any_tier=any_depth)


class MaskMirror(Protocol):
    """Where an index also writes every key's masks and every rank's sizes (another process's
    view: :class:`~rankgate.sidecar.routing.shared_index.SharedKvTable`)."""

    def set(self, key: int, tier: int, mask: int) -> None: ...

    def set_size(self, slot: int, tier: int, blocks: int) -> None: ...


class _RankTier:
    """One rank's blocks on one tier, oldest first, bounded by ``capacity``."""

    __slots__ = ("blocks", "capacity", "refs")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # vLLM's block hash -> our chained key.
        self.blocks: dict[Hashable, int] = {}
        # Our key -> how many of this rank's vLLM blocks map to it (normally 1).
        self.refs: dict[int, int] = {}


class EventIndex:
    """Blocks announced by each rank's KV events, keyed by our chained hashes.

    Memory is bounded by each rank's real capacity: a rank cannot hold more device blocks than
    discovery reported, so an overflow means removals were lost, and the oldest entry goes.
    ``mirror`` gets every change of a key's masks, for the gateway's other workers.
    """

    def __init__(
        self,
        device_capacity: Sequence[int],
        offload_capacity: Sequence[int],
        mirror: MaskMirror | None = None,
    ) -> None:
        if len(device_capacity) != len(offload_capacity):
            raise ValueError("one device and one offload capacity per slot")
        self.mirror = mirror
        self.slots = len(device_capacity)
        self.device: dict[int, int] = {}
        self.offloaded: dict[int, int] = {}
        self._tiers = [
            (_RankTier(max(1, dev)), _RankTier(max(1, off)))
            for dev, off in zip(device_capacity, offload_capacity, strict=True)
        ]
        self.evicted = 0
        # Blocks each slot holds on the device, kept as they change: read on every decision.
        self._device_sizes = [0] * self.slots

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        return match_masks(hashes, self.slots, self.device, self.offloaded or None)

    def parent_key(self, slot: int, block_hash: Hashable) -> int | None:
        """Our key for a block vLLM named as a parent, on whichever tier the rank holds it."""
        device, offloaded = self._tiers[slot]
        key = device.blocks.get(block_hash)
        if key is None:
            key = offloaded.blocks.get(block_hash)
        return key

    def store(self, slot: int, tier: int, block_hash: Hashable, key: int) -> None:
        rank_tier = self._tiers[slot][tier]
        previous = rank_tier.blocks.get(block_hash)
        if previous == key:
            return
        if previous is not None:
            self._drop(slot, tier, rank_tier, block_hash)
        elif len(rank_tier.blocks) >= rank_tier.capacity:
            oldest = next(iter(rank_tier.blocks))
            self._drop(slot, tier, rank_tier, oldest)
            self.evicted += 1
        rank_tier.blocks[block_hash] = key
        if tier == DEVICE:
            self._device_sizes[slot] = len(rank_tier.blocks)
        refs = rank_tier.refs
        count = refs.get(key, 0)
        refs[key] = count + 1
        mirror = self.mirror
        if count == 0:
            masks = self.device if tier == DEVICE else self.offloaded
            mask = masks[key] = masks.get(key, 0) | (1 << slot)
            if mirror is not None:
                mirror.set(key, tier, mask)
        if mirror is not None:
            mirror.set_size(slot, tier, len(rank_tier.blocks))

    def remove(self, slot: int, tier: int, block_hash: Hashable) -> int | None:
        """Forget one block of one rank; the key it stood for, None if it was not indexed."""
        rank_tier = self._tiers[slot][tier]
        key = rank_tier.blocks.get(block_hash)
        if key is not None:
            self._drop(slot, tier, rank_tier, block_hash)
        return key

    def clear(self, slot: int) -> None:
        """Forget everything one rank holds (AllBlocksCleared, a purge)."""
        keep = ~(1 << slot)
        mirror = self.mirror
        for tier, rank_tier in zip(TIERS, self._tiers[slot], strict=True):
            masks = self.device if tier == DEVICE else self.offloaded
            for key in rank_tier.refs:
                mask = masks.get(key, 0) & keep
                if mask:
                    masks[key] = mask
                else:
                    masks.pop(key, None)
                if mirror is not None:
                    mirror.set(key, tier, mask)
            rank_tier.blocks = {}
            rank_tier.refs = {}
            if tier == DEVICE:
                self._device_sizes[slot] = 0
            if mirror is not None:
                mirror.set_size(slot, tier, 0)

    def size(self, slot: int, tier: int = DEVICE) -> int:
        return len(self._tiers[slot][tier].blocks)

    def device_sizes(self) -> list[int]:
        """Blocks each slot holds on the device, by its events (the index's own list: read,
        never change it)."""
        return self._device_sizes

    def entries(self, slot: int, tier: int) -> list[tuple[Hashable, int]]:
        """One rank's blocks on one tier, oldest first: vLLM's hash and our key."""
        return list(self._tiers[slot][tier].blocks.items())

    def _drop(self, slot: int, tier: int, rank_tier: _RankTier, block_hash: Hashable) -> None:
        key = rank_tier.blocks.pop(block_hash)
        if tier == DEVICE:
            self._device_sizes[slot] = len(rank_tier.blocks)
        mirror = self.mirror
        if mirror is not None:
            mirror.set_size(slot, tier, len(rank_tier.blocks))
        count = rank_tier.refs[key] - 1
        if count:
            rank_tier.refs[key] = count
            return
        del rank_tier.refs[key]
        masks = self.device if tier == DEVICE else self.offloaded
        mask = masks.get(key, 0) & ~(1 << slot)
        if mask:
            masks[key] = mask
        else:
            masks.pop(key, None)
        if mirror is not None:
            mirror.set(key, tier, mask)


class PredictedIndex:
    """What each rank probably caches, learnt from where we sent prompts; entries expire.

    With KV events off this is the router's only view of the caches; with events on it covers
    the seconds between routing a prompt and its blocks' events arriving, so a burst sharing a
    new prefix lands together. Each slot is an LRU bounded by the rank's capacity, refreshed
    on every reuse, and entries older than ``ttl`` seconds count for nothing.

    A block's key covers its whole prefix (the keys are chained), so past a prompt's first
    ``dense`` blocks the index keeps one key in ``stride`` (the checkpoints, blocks
    ``stride - 1``, ``2 * stride - 1``...) and every key of its last ``stride`` blocks. A match
    walks every key of the first ``dense`` blocks, then the checkpoints, then looks, within the
    stride where a rank's prefix ended, for the furthest key recorded there. A prompt that
    shares a recorded one's tail (a conversation's next turn, which leaves the last turn's
    prompt near its end) matches to the block, a prefix shared deeper in a long body to within
    ``stride - 1`` blocks; a 55k-token prompt is 710 entries to enter on the event loop instead
    of 3,400. Each entry weighs the blocks it stands for against the rank's capacity. The first
    ``dense`` blocks stay exact: under KV pressure the predictions of prompts of a few thousand
    tokens decide where the sessions of a hot system prompt queue, and strided from the start
    they routed measurably worse (``bench/routing_simulation.py --kv-blocks 512``).

    :meth:`record` only notes the prompt, which the router settles (:meth:`settle`) once the
    request is on its way to the engine (``Router.sent``). Every read settles first, so the
    next route sees every earlier one.
    """

    def __init__(
        self,
        capacity: Sequence[int],
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
        stride: int = 16,
        dense: int = 512,
    ) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if stride < 1:
            raise ValueError("stride must be positive")
        self.slots = len(capacity)
        self.ttl = ttl
        self.stride = stride
        self._dense = dense
        self._clock = clock
        self._capacity = [max(1, c) for c in capacity]
        self.masks: dict[int, int] = {}
        # Per slot: key -> expiry, least recent first; key -> the blocks it stands for, and
        # their sum.
        self._entries: list[OrderedDict[int, float]] = [OrderedDict() for _ in capacity]
        self._weights: list[dict[int, int]] = [{} for _ in capacity]
        self._blocks = [0] * len(capacity)
        self._unsettled: list[tuple[int, Sequence[int], float]] = []
        # No entry expires before this: every read checks it, and only past it walks the
        # slots. After a walk it is at least ``ttl / 64`` ahead, so a steady stream of expiries
        # walks the slots 64 times a ``ttl`` at most, each entry living up to that much longer.
        self._due_at = math.inf

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Per slot, how many leading blocks of ``hashes`` the rank is believed to hold."""
        self.expire()
        stride = self.stride
        get = self.masks.get
        depth = [0] * self.slots
        alive = (1 << self.slots) - 1
        count = len(hashes)
        # Every key of the first ``dense`` blocks, then the checkpoints.
        dense = count if stride == 1 else min(self._dense, count)
        for at in range(dense):
            held = alive & get(hashes[at], 0)
            if held != alive:
                _record_drops(depth, alive & ~held, at)
                alive = held
                if not alive:
                    return depth
        matched = dense
        at = (matched // stride + 1) * stride - 1
        while at < count and alive:
            held = alive & get(hashes[at], 0)
            if held != alive:
                self._within(depth, alive & ~held, hashes, matched, at)
                alive = held
            matched = at + 1
            at += stride
        if alive:
            self._within(depth, alive, hashes, matched, count)
        return depth

    def _within(
        self, depth: list[int], ranks: int, hashes: Sequence[int], start: int, stop: int
    ) -> None:
        """Depths for ``ranks``, which hold ``hashes[:start]``: past it, as far as the furthest
        key before ``stop`` that each holds (a recorded prompt's last)."""
        get = self.masks.get
        at = stop - 1
        while ranks and at >= start:
            found = ranks & get(hashes[at], 0)
            if found:
                _record_drops(depth, found, at + 1)
                ranks &= ~found
            at -= 1
        if ranks:
            _record_drops(depth, ranks, start)

    def holds(self, key: int) -> bool:
        """Whether any rank is believed to hold ``key``, a checkpoint or a prompt's last
        (expired entries may still count)."""
        self.settle()
        return key in self.masks

    def record(self, slot: int, hashes: Sequence[int]) -> None:
        self._unsettled.append((slot, hashes, self._clock()))

    def settle(self) -> None:
        unsettled = self._unsettled
        if unsettled:
            self._unsettled = []
            for slot, hashes, now in unsettled:
                keys, weights = self._entries_of(hashes)
                self._settle(slot, keys, weights, now)

    def _entries_of(self, hashes: Sequence[int]) -> tuple[Sequence[int], list[int]]:
        """The keys a prompt enters, and the blocks each stands for (they add up to all)."""
        stride = self.stride
        count = len(hashes)
        dense = self._dense
        if stride == 1 or count <= dense:
            return hashes, [1] * count
        tail = max(dense, count - stride)
        positions = [
            *range(dense),
            *range((dense // stride + 1) * stride - 1, tail, stride),
            *range(tail, count),
        ]
        keys = [hashes[at] for at in positions]
        weights = [at - before for before, at in zip([-1, *positions], positions, strict=False)]
        return keys, weights

    def expire(self) -> None:
        self.settle()
        now = self._clock()
        if now < self._due_at:
            return
        due = math.inf
        for slot in range(self.slots):
            head = self._expire_slot(slot, now)
            if head < due:
                due = head
        self._due_at = max(due, now + self.ttl / 64) if due < math.inf else due

    def size(self, slot: int) -> int:
        """Blocks the slot's entries stand for."""
        self.settle()
        return self._blocks[slot]

    def _settle(self, slot: int, keys: Sequence[int], weights: list[int], now: float) -> None:
        # A long prompt is hundreds of keys entered here on the event loop, so the eviction of
        # the least recent key (:meth:`_forget`) is written out in the loop.
        expiry = now + self.ttl
        entries = self._entries[slot]
        held = self._weights[slot]
        bit = 1 << slot
        keep = ~bit
        masks = self.masks
        get = masks.get
        move = entries.move_to_end
        evict = entries.popitem
        capacity = self._capacity[slot]
        blocks = self._blocks[slot]
        for key, weight in zip(keys, weights, strict=True):
            if key in held:
                move(key)
            else:
                while blocks + weight > capacity and entries:
                    oldest = evict(last=False)[0]
                    blocks -= held.pop(oldest)
                    mask = get(oldest, 0) & keep
                    if mask:
                        masks[oldest] = mask
                    else:
                        masks.pop(oldest, None)
                masks[key] = get(key, 0) | bit
                held[key] = weight
                blocks += weight
            entries[key] = expiry
        self._blocks[slot] = blocks
        if expiry < self._due_at:
            self._due_at = expiry
        self._expire_slot(slot, now)

    def _expire_slot(self, slot: int, now: float) -> float:
        """Drop the slot's entries expired by ``now``; the expiry of the next, or infinity."""
        entries = self._entries[slot]
        while entries:
            key, expiry = next(iter(entries.items()))
            if expiry > now:
                return expiry
            del entries[key]
            self._blocks[slot] -= self._weights[slot].pop(key)
            self._forget(slot, key)
        return math.inf

    def _forget(self, slot: int, key: int) -> None:
        mask = self.masks.get(key, 0) & ~(1 << slot)
        if mask:
            self.masks[key] = mask
        else:
            self.masks.pop(key, None)
