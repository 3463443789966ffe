"""Admission per DP rank: how many engine streams each rank is given, and who waits.

Every rank admits its own number of engine streams (by default twice vLLM's
``max_running_requests`` for it, so a full batch runs and one more waits in vLLM behind it);
with ``--workers N`` each process admits ``ceil(slots / N)`` of every rank's slots. The router
is told which ranks are full and chooses among the others, so a hot prefix or a busy rank can
never be handed more than its share while another rank has room. The ``engine`` policy, where
vLLM places requests itself, admits every request (pinned ones too) against one pool: the sum
of every rank's slots.

When no eligible rank has a slot, a request waits in one bounded queue: an unpinned request
for a slot anywhere, a pinned one for a slot on its own rank only. A freed slot goes to the
best waiter that can use it, ordered by ``priority`` (lower first, vLLM's rule), then arrival.
A pinned waiter never takes another rank's slot and never holds up unpinned waiters that fit
elsewhere. The granted slots are reserved for the waiter until it runs; it then gives them
back and routes afresh among the ranks with room, so KV affinity and load are judged at launch
time. A request that opens ``weight`` streams (OpenAI ``n``) waits until that many slots are
free at once, so two such requests cannot each hold half of what both need; a waiter that does
not fit yet holds up its own queue only. Past the queue's bound, or its deadline, the request
is refused with :class:`~rankgate.sidecar.errors.GatewayOverloaded` (HTTP 429 with ``Retry-After``).
A completions batch is admitted the same way, as one request whose weight is every prompt's
choices (``Sidecar.generate_batch``): it runs whole or is refused before any prompt is sent.

The uncontended path is a comparison on admission and one counter update per stream taken or
given back; heaps, futures and timers exist only while something waits.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Iterator

import msgspec

from rankgate.sidecar.errors import EngineUnavailable, GatewayOverloaded
from rankgate.sidecar.types import EngineInfo, RequestTrace

# The key of the one pool the ``engine`` policy admits against (vLLM chooses the rank).
GROUP = -1
_REBUILD_AT = 64


class AdmissionConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Engine streams admitted per DP rank (all workers together); 0: twice the rank's
    # max_running_requests.
    per_rank: int = 0
    # Requests that may wait for a slot; 0 refuses at once when no slot is free.
    queue: int = 1024
    # Seconds a request may wait for a slot.
    timeout: float = 30.0
    # Retry-After advertised with a 429.
    retry_after: float = 1.0

    def __post_init__(self) -> None:
        if self.per_rank < 0 or self.queue < 0:
            raise ValueError("admission per_rank and queue must be >= 0")
        if self.timeout <= 0 or self.retry_after <= 0:
            raise ValueError("admission timeout and retry_after must be positive")

    def limits(self, info: EngineInfo, workers: int = 1) -> dict[int, int]:
        """Each served rank's slots in this process: ``--workers`` processes split every
        rank's slots evenly, rounding up, and each keeps at least one."""
        workers = max(workers, 1)
        running = {cap.rank: cap.max_running_requests for cap in info.capacity}
        limits = {}
        for rank in info.ranks:
            slots = self.per_rank or 2 * running.get(rank, 0)
            limits[rank] = max(-(-slots // workers), 1)
        return limits


class AdmissionSnapshot(msgspec.Struct, frozen=True, gc=False):
    """One pool's state for metrics; ``key`` is a rank, or ``GROUP`` for the ``engine``
    policy's pool (and for waiters that take a slot on any rank)."""

    key: int
    limit: int
    in_use: int
    waiting: int


class _Waiter:
    __slots__ = ("future", "holds", "key", "weight")

    def __init__(self, future: asyncio.Future[None], key: int | None, weight: int) -> None:
        self.future = future
        self.key = key
        self.weight = weight
        # Slots reserved for the waiter when it is granted, one rank per slot.
        self.holds: list[int] = []


_Entry = tuple[int, int, _Waiter]


class Admission:
    """Per-rank slots and the waiting queue of one sidecar (see the module doc)."""

    def __init__(self, config: AdmissionConfig | None = None, workers: int = 1) -> None:
        self.config = config or AdmissionConfig()
        self._workers = workers
        self.group = False
        self.limit: dict[int, int] = {}
        # Streams holding (or reserved) a slot, per key; keys of a former layout stay until
        # their streams end.
        self.used: dict[int, int] = {}
        # Keys at or over their limit: the router chooses among the other ranks.
        self.full: set[int] = set()
        # Free slots over every key.
        self.free = 0
        # Live waiters (cancelled ones may still sit in a heap until popped or compacted).
        self.waiting = 0
        self.refused_full = 0
        self.refused_late = 0
        self._anywhere: list[_Entry] = []
        self._pinned: dict[int, list[_Entry]] = {}
        self._stale = 0
        self._order = itertools.count()
        self._closed: EngineUnavailable | None = None
        retry = self.config.retry_after
        self._full_error = GatewayOverloaded(
            "The gateway is at capacity and its waiting queue is full; retry later.", retry
        )
        self._late_error = GatewayOverloaded(
            f"No capacity became free within {self.config.timeout:g} s; retry later.", retry
        )

    # ---------------------------------------------------------------- layout

    def configure(self, info: EngineInfo, group: bool = False) -> None:
        """Size every pool from a (re)discovered engine; waiters that now fit are granted."""
        limits = self.config.limits(info, self._workers)
        if group:
            limits = {GROUP: sum(limits.values())}
        self.group = group
        self.limit = limits
        for key in limits:
            self.used.setdefault(key, 0)
        for key in [key for key, used in self.used.items() if not used and key not in limits]:
            del self.used[key]
        self._recount()
        if self.waiting:
            self._grant()

    def key_of(self, rank: int | None) -> int | None:
        """The key a stream sent to ``rank`` holds its slot under; None: it holds none (a
        router that leaves the rank to vLLM outside the ``engine`` policy)."""
        if self.group:
            return GROUP
        return rank

    @property
    def in_use(self) -> int:
        return sum(self.used.values())

    def room(self, key: int) -> int:
        return self.limit.get(key, 0) - self.used.get(key, 0)

    # ---------------------------------------------------------------- taking and giving

    def fits(self, key: int | None, weight: int) -> bool:
        """Whether a request for ``weight`` slots on ``key`` (None: any rank) may go at once:
        enough is free and nobody it must not overtake is waiting."""
        if key is None:
            return not self._anywhere and self.free >= weight
        return key not in self._pinned and self.room(key) >= weight

    def take(self, key: int) -> None:
        """One stream on ``key`` holds a slot (over the limit when the caller insists)."""
        used = self.used.get(key, 0)
        self.used[key] = used + 1
        limit = self.limit.get(key, 0)
        if used < limit:
            self.free -= 1
            if used + 1 >= limit:
                self.full.add(key)

    def give(self, key: int) -> None:
        """A stream on ``key`` ended: its slot goes to the best waiter that can use it."""
        used = self.used.get(key, 0) - 1
        self.used[key] = used
        if used < self.limit.get(key, 0):
            self.free += 1
            self.full.discard(key)
            if self.waiting:
                self._grant()

    def settle(self) -> None:
        """Hand out whatever a granted waiter left free when it routed elsewhere or failed."""
        if self.waiting and self.free:
            self._grant()

    def grant(
        self, rank: int | None, weight: int, priority: int, trace: RequestTrace | None = None
    ) -> Grant:
        """The admission of one request that opens ``weight`` streams on ``rank`` (None: on
        any ranks), to enter with ``async with``; ``trace`` records it when tracing is on."""
        return Grant(self, self.key_of(rank), weight, priority, trace)

    # ---------------------------------------------------------------- waiting

    async def wait(self, key: int | None, weight: int, priority: int) -> None:
        """Wait until ``weight`` slots (clamped to what the pool can ever give) are free on
        ``key`` (None: on any ranks), reserved for this caller alone.

        On return the reservation has been given back: requests wait through :class:`Grant`,
        which takes the slots before the next await and settles afterwards. Raises
        GatewayOverloaded when the queue is full or the deadline passes, EngineUnavailable
        once closed.
        """
        if self._closed is not None:
            raise self._closed
        capacity = sum(self.limit.values()) if key is None else self.limit.get(key, 0)
        weight = min(max(weight, 1), max(capacity, 1))
        if self.fits(key, weight):
            return
        if self.waiting >= self.config.queue:
            self.refused_full += 1
            raise self._full_error
        waiter = _Waiter(asyncio.get_running_loop().create_future(), key, weight)
        entry = (priority, next(self._order), waiter)
        if key is None:
            heapq.heappush(self._anywhere, entry)
        else:
            heapq.heappush(self._pinned.setdefault(key, []), entry)
        self.waiting += 1
        if self.free:
            # What looked taken may have been a cancelled waiter still in a heap.
            self._grant()
        try:
            async with asyncio.timeout(self.config.timeout):
                await waiter.future
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self._unreserve(waiter)
                self.settle()
            elif not future.done():
                future.cancel()
            if future.cancelled():
                self.waiting -= 1
                self._stale += 1
                self._tidy(key)
                if self._stale > _REBUILD_AT and self._stale * 2 > self.waiting + self._stale:
                    self._compact()
            if isinstance(exc, TimeoutError):
                self.refused_late += 1
                raise self._late_error from None
            raise
        self._unreserve(waiter)

    def close(self, error: EngineUnavailable) -> None:
        """Refuse every waiter, and every later one, with ``error`` (shutdown)."""
        self._closed = error
        heaps = [self._anywhere, *self._pinned.values()]
        for heap in heaps:
            for _, _, waiter in heap:
                if not waiter.future.done():
                    waiter.future.set_exception(error)
                    self.waiting -= 1
        self._anywhere = []
        self._pinned = {}
        self._stale = 0

    def snapshot(self) -> Iterator[AdmissionSnapshot]:
        """Each pool's limit, slots in use and waiters (those waiting for any rank under
        ``GROUP``), for metrics; read when scraped."""
        waiting = {key: _live(heap) for key, heap in self._pinned.items()}
        anywhere = _live(self._anywhere)
        keys = list(self.limit)
        if anywhere and GROUP not in self.limit:
            keys.append(GROUP)
        for key in keys:
            count = waiting.get(key, 0) + (anywhere if key == GROUP else 0)
            yield AdmissionSnapshot(key, self.limit.get(key, 0), self.used.get(key, 0), count)

    # ---------------------------------------------------------------- internals

    def _recount(self) -> None:
        self.free = 0
        self.full = set()
        for key, limit in self.limit.items():
            used = self.used.get(key, 0)
            if used < limit:
                self.free += limit - used
            else:
                self.full.add(key)

    def _grant(self) -> None:
        while self.waiting and self.free > 0:
            best: _Entry | None = None
            best_heap: list[_Entry] | None = None
            for key, heap in list(self._pinned.items()):
                head = self._head(heap)
                if head is None:
                    del self._pinned[key]
                    continue
                if self.room(key) >= head[2].weight and (best is None or head < best):
                    best, best_heap = head, heap
            head = self._head(self._anywhere)
            if head is not None and self.free >= head[2].weight and (best is None or head < best):
                best, best_heap = head, self._anywhere
            if best is None or best_heap is None:
                return
            heapq.heappop(best_heap)
            waiter = best[2]
            self._tidy(waiter.key)
            if waiter.key is None:
                self._reserve_anywhere(waiter)
            else:
                for _ in range(waiter.weight):
                    self.take(waiter.key)
                    waiter.holds.append(waiter.key)
            self.waiting -= 1
            waiter.future.set_result(None)

    def _reserve_anywhere(self, waiter: _Waiter) -> None:
        needed = waiter.weight
        for key in self.limit:
            while needed and self.room(key) > 0:
                self.take(key)
                waiter.holds.append(key)
                needed -= 1

    def _unreserve(self, waiter: _Waiter) -> None:
        """Give a granted waiter's reserved slots back without handing them on: the waiter
        takes its own slots next, synchronously."""
        for key in waiter.holds:
            used = self.used.get(key, 0) - 1
            self.used[key] = used
            if used < self.limit.get(key, 0):
                self.free += 1
                self.full.discard(key)
        waiter.holds.clear()

    def _tidy(self, key: int | None) -> None:
        """Drop the cancelled waiters at the front of ``key``'s queue, and the queue itself
        once nobody is left in it, so the next request there takes the fast path again."""
        if key is None:
            self._head(self._anywhere)
            return
        heap = self._pinned.get(key)
        if heap is not None and self._head(heap) is None:
            del self._pinned[key]

    def _head(self, heap: list[_Entry]) -> _Entry | None:
        while heap:
            if not heap[0][2].future.done():
                return heap[0]
            heapq.heappop(heap)
            self._stale -= 1
        return None

    def _compact(self) -> None:
        self._anywhere = [entry for entry in self._anywhere if not entry[2].future.done()]
        heapq.heapify(self._anywhere)
        pinned = {}
        for key, heap in self._pinned.items():
            live = [entry for entry in heap if not entry[2].future.done()]
            if live:
                heapq.heapify(live)
                pinned[key] = live
        self._pinned = pinned
        self._stale = 0


class Grant(msgspec.Struct, eq=False):
    """One request's admission: ``async with admission.grant(...) as grant`` waits for its
    slots, and the body launches its streams, each holding a slot through :meth:`take`.

    The body must take its slots without awaiting: a woken waiter's reserved slots are free
    again when it resumes, so the router can judge affinity and load among every rank with room
    at launch time, and only the event loop's turn keeps another request from taking them
    first. Leaving hands on whatever the body left free (it routed elsewhere, or failed).
    """

    _admission: Admission
    _key: int | None
    _weight: int
    _priority: int
    _trace: RequestTrace | None = None
    _waited: bool = False

    async def __aenter__(self) -> Grant:
        """Raises GatewayOverloaded when the queue is full or the wait times out,
        EngineUnavailable once admission is closed."""
        admission = self._admission
        trace = self._trace
        if admission.fits(self._key, self._weight):
            if trace is not None:
                trace.admission(False, time.time_ns())
            return self
        self._waited = True
        if trace is None:
            await admission.wait(self._key, self._weight, self._priority)
            return self
        start = time.time_ns()
        try:
            await admission.wait(self._key, self._weight, self._priority)
        except BaseException as error:
            trace.admission(True, start, str(error) or type(error).__name__)
            raise
        trace.admission(True, start)
        return self

    async def __aexit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if self._waited:
            self._admission.settle()

    def take(self, rank: int | None) -> int | None:
        """Hold a slot for one stream sent to ``rank`` (None: vLLM chooses), over the limit
        when the body insists; the key to give it back under (None: the stream holds none)."""
        admission = self._admission
        key = GROUP if admission.group else rank  # admission.key_of, on the per-stream path
        if key is not None:
            admission.take(key)
        return key


def _live(heap: list[_Entry]) -> int:
    return sum(1 for entry in heap if not entry[2].future.done())
