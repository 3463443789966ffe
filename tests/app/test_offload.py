"""app.offload: big requests' work runs on threads that yield the CPU to the event loop."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from rankgate.app.offload import NICENESS, offload


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
async def test_offloaded_work_runs_below_the_loops_priority() -> None:
    def niceness() -> tuple[int, str]:
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return own, threading.current_thread().name

    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker_nice, name = await offload(niceness)
    assert name.startswith("rankgate-offload")
    assert worker_nice == min(19, loop_nice + NICENESS) or worker_nice == NICENESS
    assert worker_nice > loop_nice
    # The loop's own thread is left as it was.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice


async def test_offload_passes_arguments_and_returns_the_result() -> None:
    assert await offload(divmod, 17, 5) == (3, 2)
    with pytest.raises(ZeroDivisionError):
        await offload(divmod, 1, 0)
