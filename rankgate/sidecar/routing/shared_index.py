"""The KV-event index's rank masks in shared memory: one intake for all ``--workers``.

Every worker used to subscribe to every rank's KV events and apply every batch itself, so N
workers paid N times for each batch (ZMQ's I/O thread, the intake thread's wake-up, decoding)
and two workers spent 1.4-1.5x one worker's CPU per request. Now one worker, the first, runs
the intake; its :class:`~rankgate.sidecar.routing.index.EventIndex` writes every change of a key's
rank masks through to a :class:`SharedKvTable`, and the other workers answer "which ranks hold these
blocks?" from that table without receiving an event.

The table is open addressing with linear probing over int64 cells: a header, then per entry
(key, device mask, offloaded mask). An entry whose masks are both zero is empty, deletions
shift later entries back, and the writer keeps the load factor at or under one half. There is
one writer and no lock: an aligned 8-byte store is atomic on the CPUs we run on, and a reader
that catches an entry mid-move sees a block as not held for that one request, a routing hint
lost, never a wrong answer about anything but cache reuse. Keys are the router's chained block
hashes (:mod:`rankgate.sidecar.routing.hashing`), the same in every process.

Which table is current lives in the load board's header (its generation): the writer makes a
new table whenever its topology is (re)configured, or when a restarted first worker takes the
intake over, and readers follow the generation on their next route.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from multiprocessing import shared_memory

from rankgate.sidecar.routing.index import PrefixMatch
from rankgate.sidecar.routing.shared_load import SharedLoadBoard

log = logging.getLogger(__name__)

MAGIC = 0x52474B5631  # "RGKV1"
# Rank masks are int64 cells: bit 63 is the sign, so 63 ranks at most share one table.
MAX_SLOTS = 63
MIN_ENTRIES = 1024
_MAGIC, _ENTRIES, _SLOTS, _COUNT = 0, 1, 2, 3
_FIXED = 4
_ITEM = 8
_WIDTH = 3  # key, device mask, offloaded mask


def table_entries(max_keys: int) -> int:
    """Entries for at most ``max_keys`` keys at a load factor of one half (a power of two)."""
    entries = MIN_ENTRIES
    while entries < 2 * max_keys:
        entries *= 2
    return entries


def table_name(board: SharedLoadBoard, generation: int) -> str:
    return f"{board.name}_kv{generation}"


def remove(name: str) -> None:
    """Unlink a table by name, if it is there: one a crashed writer left behind. Readers that
    have it mapped keep their mapping until they move on."""
    with contextlib.suppress(FileNotFoundError):
        stale = shared_memory.SharedMemory(name=name)
        stale.close()
        stale.unlink()


class SharedKvTable:
    """A handle on one table: :meth:`create` by the intake's worker, :meth:`attach` by readers."""

    __slots__ = ("_base", "_cells", "_mask", "_owner", "_shm", "entries", "slots")

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        buf = shm.buf
        assert buf is not None
        cells = buf.cast("q")
        if len(cells) < _FIXED or cells[_MAGIC] != MAGIC:
            cells.release()
            raise ValueError(f"{shm.name} is not a KV table")
        self._shm = shm
        self._owner = owner
        self._cells = cells
        self.entries = cells[_ENTRIES]
        self.slots = cells[_SLOTS]
        self._mask = self.entries - 1
        self._base = _FIXED + 2 * self.slots

    @staticmethod
    def _size(entries: int, slots: int) -> int:
        return (_FIXED + 2 * slots + _WIDTH * entries) * _ITEM

    @classmethod
    def create(cls, name: str, slots: int, max_keys: int) -> SharedKvTable:
        """An empty table for ``slots`` ranks and up to ``max_keys`` keys, removed on close."""
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"a shared KV table holds 1 to {MAX_SLOTS} ranks, not {slots}")
        entries = table_entries(max_keys)
        remove(name)
        # A new block is zero-filled by the OS (a fresh file in /dev/shm).
        shm = shared_memory.SharedMemory(name=name, create=True, size=cls._size(entries, slots))
        buf = shm.buf
        assert buf is not None
        cells = buf.cast("q")
        cells[_ENTRIES] = entries
        cells[_SLOTS] = slots
        cells[_MAGIC] = MAGIC  # last: a reader trusts the header once it reads the magic
        cells.release()
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> SharedKvTable:
        # Workers share the supervisor's resource tracker: attaching registers nothing the
        # writer's unlink does not remove.
        shm = shared_memory.SharedMemory(name=name)
        try:
            return cls(shm, owner=False)
        except BaseException:
            shm.close()
            raise

    @property
    def name(self) -> str:
        return self._shm.name

    def __len__(self) -> int:
        return self._cells[_COUNT]

    def close(self) -> None:
        """Detach; the writer also removes the table."""
        self._cells.release()
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()

    # --- the writer -----------------------------------------------------------------------

    def set(self, key: int, tier: int, mask: int) -> None:
        """Make ``key``'s mask on ``tier`` (0 device, 1 offloaded) ``mask``."""
        cells = self._cells
        wrap = self._mask
        base = self._base
        column = 1 + tier
        i = key & wrap
        while True:
            at = base + _WIDTH * i
            if not cells[at + 1] and not cells[at + 2]:
                if mask:
                    # Key first: until the mask lands a reader sees an empty entry.
                    cells[at] = key
                    cells[at + column] = mask
                    cells[_COUNT] += 1
                return
            if cells[at] == key:
                cells[at + column] = mask
                if not mask and not cells[at + 3 - column]:
                    self._delete(i)
                return
            i = (i + 1) & wrap

    def set_size(self, slot: int, tier: int, blocks: int) -> None:
        """The writer's count of ``slot``'s blocks on ``tier``, for every worker's snapshot."""
        self._cells[_FIXED + 2 * slot + tier] = blocks

    def _delete(self, hole: int) -> None:
        """Close the hole at ``hole`` (already empty) by shifting back the run after it."""
        cells = self._cells
        wrap = self._mask
        base = self._base
        j = hole
        while True:
            j = (j + 1) & wrap
            at = base + _WIDTH * j
            if not cells[at + 1] and not cells[at + 2]:
                break
            key = cells[at]
            home = key & wrap
            # The entry may move into the hole unless its home lies cyclically in (hole, j].
            if (hole < j and hole < home <= j) or (j < hole and (home > hole or home <= j)):
                continue
            to = base + _WIDTH * hole
            cells[to] = key
            cells[to + 1] = cells[at + 1]
            cells[to + 2] = cells[at + 2]
            hole = j
        at = base + _WIDTH * hole
        cells[at + 1] = 0
        cells[at + 2] = 0
        cells[_COUNT] -= 1

    # --- readers --------------------------------------------------------------------------

    def get(self, key: int) -> tuple[int, int]:
        """(device mask, offloaded mask) of ``key``; (0, 0) when no rank holds it."""
        cells = self._cells
        wrap = self._mask
        base = self._base
        i = key & wrap
        while True:
            at = base + _WIDTH * i
            device = cells[at + 1]
            offloaded = cells[at + 2]
            if not device and not offloaded:
                return 0, 0
            if cells[at] == key:
                return device, offloaded
            i = (i + 1) & wrap

    def size(self, slot: int, tier: int) -> int:
        if not 0 <= slot < self.slots:
            return 0
        return self._cells[_FIXED + 2 * slot + tier]

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        """Per slot, the leading blocks held on device and on any tier (as ``match_masks``)."""
        slots = self.slots
        full = (1 << slots) - 1
        dev_alive = any_alive = full
        dev_depth = [0] * slots
        any_depth = [0] * slots
        get = self.get
        depth = len(hashes)
        for at, key in enumerate(hashes):
            device, offloaded = get(key)
            now_dev = dev_alive & device
            if now_dev != dev_alive:
                _record(dev_depth, dev_alive & ~now_dev, at)
                dev_alive = now_dev
            now_any = any_alive & (device | offloaded)
            if now_any != any_alive:
                _record(any_depth, any_alive & ~now_any, at)
                any_alive = now_any
                if not any_alive:
                    depth = at
                    break
        _record(dev_depth, dev_alive, depth)
        _record(any_depth, any_alive, depth)
        return PrefixMatch(device=dev_depth, any_tier=any_depth)


def _record(depths: list[int], dropped: int, depth: int) -> None:
    while dropped:
        low = dropped & -dropped
        depths[low.bit_length() - 1] = depth
        dropped ^= low


class SharedKvReader:
    """A worker's view of the intake worker's current table, followed by generation."""

    def __init__(self, board: SharedLoadBoard, slots: int) -> None:
        self._board = board
        self._slots = slots
        self._generation = 0
        self._table: SharedKvTable | None = None

    def table(self) -> SharedKvTable | None:
        """The current table, or None while the intake's worker has none (or one for another
        topology: its ranks and ours disagree until both have rediscovered)."""
        generation = self._board.kv_generation
        if generation != self._generation:
            self._switch(generation)
        return self._table

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
            self._table = None
        self._generation = 0

    def _switch(self, generation: int) -> None:
        self.close()
        self._generation = generation
        if not generation:
            return
        try:
            table = SharedKvTable.attach(table_name(self._board, generation))
        except (FileNotFoundError, ValueError):
            # Replaced already, or not finished: the next route looks again.
            self._generation = 0
            return
        if table.slots != self._slots:
            log.info(
                "the shared KV table is for %d ranks, this worker routes %d: not using it yet",
                table.slots,
                self._slots,
            )
            table.close()
            return
        self._table = table
