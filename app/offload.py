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
from the loop, and with eight such threads sharing one CPU the loop went 30 ms at a time
without it (p99 of its wake-ups), against 1.3 ms with one thread for the same encoding work
(``bench/offload_threads.py``). Work a running gateway can do without (:func:`background`)
has a thread of its own, so a long check never queues a request's work behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

# Below the loop's priority by enough that the scheduler gives the loop about ten times the
# share of a busy offload thread (CFS weights 1024 and 110).
NICENESS = 10
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


_pool = ThreadPoolExecutor(
    max_workers=usable_cpus(),
    thread_name_prefix="rankgate-offload",
    initializer=_lower_priority,
)
_background = ThreadPoolExecutor(
    max_workers=1,
    thread_name_prefix="rankgate-background",
    initializer=_lower_priority,
)


async def offload(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` on a low-priority worker thread."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


def background(fn: Callable[_P, object], *args: _P.args, **kwargs: _P.kwargs) -> None:
    """``fn(*args, **kwargs)`` on a low-priority worker thread, not awaited: work a running
    gateway can do without, such as a check that switches on a faster path once it passes."""
    _background.submit(fn, *args, **kwargs)
