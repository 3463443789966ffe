"""Work a big request needs done off the event loop, on threads that yield the CPU to it.

Tokenizing, rendering and measuring a prompt of hundreds of kilobytes takes tens of
milliseconds of CPU. Done on the event loop it would hold every other request; done on
ordinary threads it still competes for the same cores as the loop, and a few big prompts in
flight slow every short request beside them by the loop's lost share. These threads run at a
lower priority (``nice`` +10 on Linux, per thread), so the loop, whose work for a short
request is short, gets the CPU first whenever it has any; the big requests take what is
left, which under load is most of it.

There are no more of these threads than CPUs the process may use. The work is CPU-bound, and
the tokenizers release the GIL while they encode, so threads beyond the CPUs add no throughput,
only handovers of the GIL: each time one returns from the tokenizer to Python it takes the GIL
from the loop, and with eight such threads sharing one CPU the loop's wake-ups came 27-29 ms
late at p99, against 1.6 ms with one thread doing the same encoding (``bench/offload_threads.py``).

With few threads, work waits its turn, and a queue in arrival order would hold a 20 KB prompt
behind every megabyte prompt queued before it. The queue is ordered by estimated finish
instead: the time the work was queued plus its size at a nominal rate (:data:`SECONDS_PER_BYTE`).
A medium prompt passes huge ones queued just before it, and no work waits on later arrivals
for longer than about its own size's worth. Work a running gateway can do without
(:func:`background`) has a thread of its own, so a long check never holds up a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

# Below the loop's priority by enough that the scheduler gives the loop about ten times the
# share of a busy offload thread (CFS weights 1024 and 110).
NICENESS = 10
# The queue's exchange rate between waiting and size: a megabyte of input goes behind work
# queued up to a second after it. Well above what tokenizing costs a byte (tiktoken encodes
# 220 KB of prose in about 15 ms here), so a medium prompt passes every big one a full queue
# holds, while a big one still waits on later arrivals for a bounded time.
SECONDS_PER_BYTE = 1e-6
_P = ParamSpec("_P")
_T = TypeVar("_T")


def _lower_priority() -> None:
    # Linux gives every thread its own nice value; elsewhere this is the process's (skipped).
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)


def usable_cpus() -> int:
    """The CPUs this process may keep busy: those it may run on (its affinity, which
    ``taskset`` and cpusets narrow), fewer under a cgroup CPU quota (``docker --cpus``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_quota(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """CPUs' worth of time a cgroup v2 quota allows (``"max 100000"`` is none)."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


@dataclass(order=True)
class _Work:
    due: float
    order: int
    run: Callable[[], Any] = field(compare=False)
    future: Future[Any] = field(compare=False)


class FinishOrderedPool:
    """Worker threads at the offload priority that take queued work soonest-due first."""

    def __init__(
        self, workers: int, name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.workers = workers
        self._name = name
        # Injectable so that a test can age queued work without waiting.
        self._clock = clock
        self._queue: queue.PriorityQueue[_Work] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._started = 0
        if hasattr(os, "register_at_fork"):
            # A forked child has none of its parent's threads: it starts its own.
            os.register_at_fork(after_in_child=self._forget_threads)

    def submit(self, run: Callable[[], _T], size: int) -> Future[_T]:
        """``run()`` on a worker, queued as due ``size`` bytes' worth after now."""
        future: Future[_T] = Future()
        due = self._clock() + size * SECONDS_PER_BYTE
        self._queue.put(_Work(due, next(self._order), run, future))
        if self._started < self.workers:
            self._start()
        return future

    def _start(self) -> None:
        with self._lock:
            while self._started < self.workers:
                self._started += 1
                name = f"{self._name}_{self._started}"
                threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        _lower_priority()
        while True:
            work = self._queue.get()
            # False when the awaiting request was cancelled (its client left) meanwhile.
            if not work.future.set_running_or_notify_cancel():
                continue
            try:
                result = work.run()
            except BaseException as exc:
                work.future.set_exception(exc)
            else:
                work.future.set_result(result)
            del work

    def _forget_threads(self) -> None:
        self._queue = queue.PriorityQueue()
        self._lock = threading.Lock()
        self._started = 0


_pool = FinishOrderedPool(usable_cpus(), "rankgate-offload")
_background = ThreadPoolExecutor(
    max_workers=1,
    thread_name_prefix="rankgate-background",
    initializer=_lower_priority,
)


async def offload(size: int, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` on a low-priority worker thread; ``size`` (bytes of the input it
    reads) places it in the queue. Cancelling the caller drops work not yet started."""
    return await asyncio.wrap_future(_pool.submit(functools.partial(fn, *args, **kwargs), size))


def background(fn: Callable[_P, object], *args: _P.args, **kwargs: _P.kwargs) -> None:
    """``fn(*args, **kwargs)`` on a low-priority worker thread, not awaited: work a running
    gateway can do without, such as a check that switches on a faster path once it passes."""
    _background.submit(fn, *args, **kwargs)
