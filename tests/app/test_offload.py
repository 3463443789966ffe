"""rankgate.app.serving.offload: big requests' work runs on threads that yield the CPU to the event
loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest

from rankgate.app.serving.offload import (
    NICENESS,
    SECONDS_PER_BYTE,
    FinishOrderedPool,
    _cgroup_quota,
    background,
    offload,
    usable_cpus,
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
async def test_offloaded_work_runs_below_the_loops_priority() -> None:
    def niceness() -> tuple[int, str]:
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return own, threading.current_thread().name

    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker_nice, name = await offload(0, niceness)
    assert name.startswith("rankgate-offload")
    assert worker_nice == min(19, loop_nice + NICENESS) or worker_nice == NICENESS
    assert worker_nice > loop_nice
    # The loop's own thread is left as it was.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice


async def test_offload_passes_arguments_and_returns_the_result() -> None:
    assert await offload(100, divmod, 17, 5) == (3, 2)
    with pytest.raises(ZeroDivisionError):
        await offload(100, divmod, 1, 0)


async def test_offload_threads_never_outnumber_the_usable_cpus() -> None:
    # More threads than CPUs add no throughput to CPU-bound work, only GIL handovers that
    # keep the loop waiting (bench/offload_threads.py).
    started = threading.Barrier(2, timeout=0.2)

    def which() -> str:
        with contextlib.suppress(threading.BrokenBarrierError):
            started.wait()
        return threading.current_thread().name

    names = await asyncio.gather(*(offload(0, which) for _ in range(32)))
    assert 1 <= len(set(names)) <= usable_cpus()


def test_usable_cpus_is_within_the_affinity() -> None:
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("max 100000\n", None),
        ("150000 100000\n", 1.5),
        ("200000 100000", 2.0),
        ("50000 100000\n", 0.5),
        ("", None),
        ("lots of\n", None),
        ("100000 0\n", None),
    ],
)
def test_cgroup_quota(tmp_path: Path, content: str, expected: float | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(content)
    assert _cgroup_quota(str(path)) == expected


def test_cgroup_quota_without_the_file(tmp_path: Path) -> None:
    assert _cgroup_quota(str(tmp_path / "absent")) is None


async def test_background_work_does_not_hold_up_offloaded_work() -> None:
    running = threading.Event()
    release = threading.Event()
    names: list[str] = []

    def long_check() -> None:
        names.append(threading.current_thread().name)
        running.set()
        release.wait(10)

    background(long_check)
    try:
        assert await asyncio.to_thread(running.wait, 10)
        # Every offload thread is free: the check runs on a thread of its own.
        results = await asyncio.wait_for(
            asyncio.gather(*(offload(n, divmod, n, 3) for n in range(usable_cpus() * 2))), 10
        )
        assert results == [divmod(n, 3) for n in range(usable_cpus() * 2)]
    finally:
        release.set()
    assert names[0].startswith("rankgate-background")


def _busy(pool: FinishOrderedPool) -> threading.Event:
    """Every worker of ``pool`` held until the returned event is set."""
    release = threading.Event()
    running = threading.Semaphore(0)

    def hold() -> None:
        running.release()
        release.wait(10)

    for _ in range(pool.workers):
        pool.submit(hold, 0)
    for _ in range(pool.workers):
        assert running.acquire(timeout=10)
    return release


def test_smaller_work_passes_bigger_work_queued_before_it() -> None:
    pool = FinishOrderedPool(1, "test-order")
    release = _busy(pool)
    ran: list[str] = []
    huge = pool.submit(lambda: ran.append("1 MB"), 1 << 20)
    medium = pool.submit(lambda: ran.append("20 KB"), 20_000)
    first = pool.submit(lambda: ran.append("20 KB, later"), 20_000)
    release.set()
    for future in (huge, medium, first):
        future.result(10)
    # Equal sizes keep their order of arrival.
    assert ran == ["20 KB", "20 KB, later", "1 MB"]


def test_work_is_not_passed_by_much_smaller_work_arriving_long_after() -> None:
    now = [0.0]
    pool = FinishOrderedPool(1, "test-aging", clock=lambda: now[0])
    release = _busy(pool)
    ran: list[str] = []
    big = pool.submit(lambda: ran.append("big"), 1_000)
    now[0] += 10_000 * SECONDS_PER_BYTE
    later = pool.submit(lambda: ran.append("small, later"), 0)
    release.set()
    big.result(10)
    later.result(10)
    assert ran == ["big", "small, later"]


async def test_cancelled_work_that_has_not_started_never_runs() -> None:
    pool = FinishOrderedPool(1, "test-cancel")
    release = _busy(pool)
    ran = threading.Event()
    waiting = asyncio.ensure_future(asyncio.wrap_future(pool.submit(ran.set, 0)))
    await asyncio.sleep(0)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0)  # the loop passes the cancellation on to the queued work
    release.set()
    # The worker is free again and has passed over the cancelled work.
    assert pool.submit(lambda: 42, 0).result(10) == 42
    assert not ran.is_set()


def test_work_that_raises_hands_its_error_to_the_caller() -> None:
    pool = FinishOrderedPool(1, "test-raise")
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 // 0, 0).result(10)
    assert pool.submit(lambda: "still serving", 0).result(10) == "still serving"
