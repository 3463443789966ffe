"""Admission control: how many engine requests the gateway lets through, and who waits.

The limit comes from what discovery learnt: every DP rank admits ``per_rank`` engine requests
(by default twice vLLM's ``max_running_requests``, so each rank keeps a full batch running and
one queued behind it). Past the limit a request waits in a bounded queue ordered by its
``priority`` (lower first, as vLLM orders it), then by arrival; when the queue is full or the
wait passes its deadline the client gets 429 with ``Retry-After`` instead of piling up memory
in the gateway or in vLLM. A request weighs as many slots as the engine streams it opens
(``n`` times its prompts).

The common case, a free slot and nobody waiting, is two integer operations and one small
object; the heap is touched only under overload.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass

from app.errors import RATE_LIMIT, UNAVAILABLE, ApiError
from sidecar.types import EngineInfo

_REBUILD_AT = 64


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    # Engine requests admitted per DP rank; 0: twice the rank's max_running_requests.
    per_rank: int = 0
    # Requests that may wait for a slot; 0 refuses at once when the limit is reached.
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

    def limit(self, info: EngineInfo, workers: int = 1) -> int:
        """This process's share: ``--workers`` processes split the engine's slots evenly."""
        if self.per_rank:
            total = self.per_rank * max(len(info.capacity), 1)
        else:
            total = sum(2 * cap.max_running_requests for cap in info.capacity)
        return max(-(-total // workers), 1)


class Permit:
    """One admitted request's slots; :meth:`release` is idempotent."""

    __slots__ = ("_owner", "weight")

    def __init__(self, owner: Admission | None, weight: int) -> None:
        self._owner = owner
        self.weight = weight

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._give_back(self.weight)


class _Waiter:
    __slots__ = ("future", "weight")

    def __init__(self, future: asyncio.Future[None], weight: int) -> None:
        self.future = future
        self.weight = weight


class Admission:
    def __init__(self, config: AdmissionConfig, workers: int = 1) -> None:
        self.config = config
        self._workers = workers
        self._info: EngineInfo | None = None
        self.limit = 0
        self.in_use = 0
        self.waiting = 0
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._stale = 0
        self._order = itertools.count()
        self._closed: str | None = None
        self._full = ApiError(
            429,
            "The gateway is at capacity and its waiting queue is full; retry later.",
            type=RATE_LIMIT,
            code="gateway_overloaded",
            retry_after=config.retry_after,
        )
        self._late = ApiError(
            429,
            f"No capacity became free within {config.timeout:g} s; retry later.",
            type=RATE_LIMIT,
            code="gateway_overloaded",
            retry_after=config.retry_after,
        )

    async def acquire(self, info: EngineInfo, weight: int, priority: int = 0) -> Permit:
        """Slots for a request that opens ``weight`` engine streams, or a 429."""
        if info is not self._info:
            self._resize(info)
        if self._closed is not None:
            raise self._closing()
        weight = min(max(weight, 1), self.limit)
        if not self.waiting and self.in_use + weight <= self.limit:
            self.in_use += weight
            return Permit(self, weight)
        if self.waiting >= self.config.queue:
            raise self._full
        waiter = _Waiter(asyncio.get_running_loop().create_future(), weight)
        heapq.heappush(self._heap, (priority, next(self._order), waiter))
        self.waiting += 1
        try:
            async with asyncio.timeout(self.config.timeout):
                await waiter.future
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self._give_back(weight)
            elif not future.done():
                future.cancel()
            if future.cancelled():
                self.waiting -= 1
                self._stale += 1
                if self._stale > _REBUILD_AT and self._stale * 2 > len(self._heap):
                    self._compact()
            if isinstance(exc, TimeoutError):
                raise self._late from None
            raise
        return Permit(self, weight)

    def close(self, reason: str = "the gateway is shutting down") -> None:
        """Refuse new requests and every waiting one with 503 (shutdown)."""
        self._closed = reason
        error = self._closing()
        for _, _, waiter in self._heap:
            if not waiter.future.done():
                waiter.future.set_exception(error)
                self.waiting -= 1
        self._heap.clear()
        self._stale = 0

    def _closing(self) -> ApiError:
        return ApiError(
            503,
            self._closed or "",
            type=UNAVAILABLE,
            code="shutting_down",
            retry_after=self.config.retry_after,
        )

    def _resize(self, info: EngineInfo) -> None:
        self._info = info
        self.limit = self.config.limit(info, self._workers)
        self._grant()

    def _give_back(self, weight: int) -> None:
        self.in_use -= weight
        if self.waiting:
            self._grant()

    def _grant(self) -> None:
        heap = self._heap
        while heap:
            waiter = heap[0][2]
            if waiter.future.done():
                heapq.heappop(heap)
                self._stale -= 1
                continue
            if self.in_use + waiter.weight > self.limit:
                return
            heapq.heappop(heap)
            self.in_use += waiter.weight
            self.waiting -= 1
            waiter.future.set_result(None)

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if not entry[2].future.done()]
        heapq.heapify(self._heap)
        self._stale = 0
