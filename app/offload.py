"""Work a big request needs done off the event loop, on threads that yield the CPU to it.

Tokenizing, rendering and measuring a prompt of hundreds of kilobytes takes tens of
milliseconds of CPU. Done on the event loop it would hold every other request; done on
ordinary threads it still competes for the same cores as the loop, and a few big prompts in
flight slow every short request beside them by the loop's lost share. These threads run at a
lower priority (``nice`` +10 on Linux, per thread), so the loop, whose work for a short
request is short, gets the CPU first whenever it has any; the big requests take what is
left, which under load is most of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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


_pool = ThreadPoolExecutor(
    max_workers=min(32, (os.cpu_count() or 1) + 4),
    thread_name_prefix="rankgate-offload",
    initializer=_lower_priority,
)


async def offload(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` on a low-priority worker thread."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


def background(fn: Callable[_P, object], *args: _P.args, **kwargs: _P.kwargs) -> None:
    """``fn(*args, **kwargs)`` on a low-priority worker thread, not awaited: work a running
    gateway can do without, such as a check that switches on a faster path once it passes."""
    _pool.submit(fn, *args, **kwargs)
