"""Per-rank load counts shared by the gateway's worker processes through shared memory.

With ``--workers N`` every process routes on its own, so each one must see the requests the
others have in flight, or N workers would each believe a rank idle and pile onto it. The board
is one ``multiprocessing.shared_memory`` block holding a table of signed 64-bit counters:
a row per worker, three columns per DP rank (in flight, prompt tokens waiting for prefill,
tokens held in decode). Each worker writes only its own row, and readers sum the other rows,
so no lock is needed: an aligned 8-byte store is atomic on the CPUs we run on, and a reader
that sees one counter a moment early or late is as good as the next sync.

Columns are keyed by DP rank id, not by a router's slot order, so a request counted before a
topology change is still subtracted from the right counter when it finishes.

A header before the rows names the current shared KV-event table
(:mod:`rankgate.sidecar.routing.shared_index`) by its generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing import shared_memory

FIELDS = 3
IN_FLIGHT, PREFILL, DECODE = 0, 1, 2
# Ranks above this id are not shared (counted by their own worker only).
MAX_RANKS = 512
_ITEM = 8
_HEADER = 8
_KV_GENERATION = 0


class SharedLoadBoard:
    """A handle on the table; :meth:`create` in the supervisor, :meth:`attach` in workers."""

    __slots__ = ("_cells", "_mine", "_owner", "_row", "_shm", "max_ranks", "worker", "workers")

    def __init__(
        self,
        shm: shared_memory.SharedMemory,
        workers: int,
        worker: int,
        max_ranks: int,
        owner: bool,
    ) -> None:
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} is out of range for {workers} workers")
        if shm.size < _size(workers, max_ranks):
            raise ValueError("the shared load block is smaller than its table")
        self._shm = shm
        self._owner = owner
        self.workers = workers
        self.worker = worker
        self.max_ranks = max_ranks
        self._row = max_ranks * FIELDS
        buf = shm.buf
        assert buf is not None
        self._cells = buf.cast("q")
        self._mine = _HEADER + worker * self._row

    @classmethod
    def create(cls, workers: int, max_ranks: int = MAX_RANKS) -> SharedLoadBoard:
        """A zeroed table owned (and unlinked on :meth:`close`) by the calling process."""
        if workers < 1:
            raise ValueError("workers must be at least 1")
        if max_ranks < 1:
            raise ValueError("max_ranks must be at least 1")
        size = _size(workers, max_ranks)
        # A new block is zero-filled by the OS (it is a fresh file in /dev/shm).
        shm = shared_memory.SharedMemory(create=True, size=size)
        return cls(shm, workers, 0, max_ranks, owner=True)

    @classmethod
    def attach(
        cls, name: str, workers: int, worker: int, max_ranks: int = MAX_RANKS
    ) -> SharedLoadBoard:
        """Open the supervisor's table as ``worker``, which owns row ``worker``."""
        # Workers are spawned by the supervisor and share its resource tracker, so this
        # attach adds nothing the supervisor's unlink does not remove.
        shm = shared_memory.SharedMemory(name=name)
        try:
            return cls(shm, workers, worker, max_ranks, owner=False)
        except BaseException:
            shm.close()
            raise

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def kv_generation(self) -> int:
        """The current shared KV table's generation; 0 while there is none."""
        return self._cells[_KV_GENERATION]

    @kv_generation.setter
    def kv_generation(self, generation: int) -> None:
        self._cells[_KV_GENERATION] = generation

    def shares(self, rank: int) -> bool:
        return 0 <= rank < self.max_ranks

    def add(self, rank: int, in_flight: int, prefill: int, decode: int) -> None:
        """Move this worker's counts of ``rank`` by the given amounts."""
        if not 0 <= rank < self.max_ranks:
            return
        cells = self._cells
        at = self._mine + rank * FIELDS
        if in_flight:
            cells[at] += in_flight
        if prefill:
            cells[at + PREFILL] += prefill
        if decode:
            cells[at + DECODE] += decode

    def others(self, ranks: Sequence[int], out: list[list[int]]) -> None:
        """Write into ``out[field][slot]`` the sum of every other worker's counts of ``ranks``."""
        cells = self._cells
        row = self._row
        mine = self._mine
        flight, prefill, decode = out
        for slot, rank in enumerate(ranks):
            f = p = d = 0
            if 0 <= rank < self.max_ranks:
                at = rank * FIELDS
                for base in range(_HEADER, _HEADER + self.workers * row, row):
                    if base != mine:
                        i = base + at
                        f += cells[i]
                        p += cells[i + PREFILL]
                        d += cells[i + DECODE]
            flight[slot] = f
            prefill[slot] = p
            decode[slot] = d

    def totals(self, rank: int) -> tuple[int, int, int]:
        """Every worker's counts of ``rank`` summed (in flight, prefill, decode)."""
        if not 0 <= rank < self.max_ranks:
            return 0, 0, 0
        cells = self._cells
        at = rank * FIELDS
        f = p = d = 0
        for base in range(_HEADER, _HEADER + self.workers * self._row, self._row):
            f += cells[base + at]
            p += cells[base + at + PREFILL]
            d += cells[base + at + DECODE]
        return f, p, d

    def clear(self, worker: int) -> None:
        """Zero a worker's row: the supervisor does this when that worker died, since its
        requests died with it."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is out of range for {self.workers} workers")
        start = _HEADER + worker * self._row
        cells = self._cells
        for i in range(start, start + self._row):
            cells[i] = 0

    def close(self) -> None:
        """Detach; the creating process also removes the block."""
        self._cells.release()
        self._shm.close()
        if self._owner:
            self._shm.unlink()


def _size(workers: int, max_ranks: int) -> int:
    return (_HEADER + workers * max_ranks * FIELDS) * _ITEM
