"""Admission control on its own: limits from capacity, priority order, deadlines, cancelled
waiters, shutdown, and no bookkeeping left behind."""

from __future__ import annotations

import asyncio

import pytest

from app.admission import Admission, AdmissionConfig, Permit
from app.errors import ApiError
from sidecar.types import RankCapacity
from tests.app.scripted import scripted_info
from tests.conftest import TINY_TOKENIZER

INFO = scripted_info(TINY_TOKENIZER)  # two ranks, max_running_requests 8 each


def test_limit_from_capacity_and_workers() -> None:
    assert AdmissionConfig().limit(INFO) == 32
    assert AdmissionConfig(per_rank=3).limit(INFO) == 6
    assert AdmissionConfig().limit(INFO, workers=3) == 11
    bigger = INFO.__class__(
        **{
            **{f: getattr(INFO, f) for f in INFO.__struct_fields__},
            "capacity": (RankCapacity(0, 10, 100), RankCapacity(1, 10, 50)),
        }
    )
    assert AdmissionConfig().limit(bigger) == 300


async def test_priority_then_arrival_order() -> None:
    admission = Admission(AdmissionConfig(per_rank=1, queue=10, timeout=5))
    held = [await admission.acquire(INFO, 1) for _ in range(2)]
    order: list[str] = []

    async def wait(name: str, priority: int) -> Permit:
        permit = await admission.acquire(INFO, 1, priority)
        order.append(name)
        return permit

    tasks = []
    for name, priority in (("late", 5), ("first", -1), ("second", 0), ("third", 0)):
        tasks.append(asyncio.create_task(wait(name, priority)))
        await asyncio.sleep(0)
    assert admission.waiting == 4
    for permit in held:
        permit.release()
        permit.release()  # idempotent
    await asyncio.sleep(0)
    assert order == ["first", "second"]
    for task in tasks[1:3]:
        (await task).release()
    await asyncio.sleep(0)
    assert order == ["first", "second", "third", "late"]
    for task in (tasks[0], tasks[3]):
        (await task).release()
    assert (admission.in_use, admission.waiting) == (0, 0)


async def test_full_queue_and_deadline_are_429() -> None:
    admission = Admission(AdmissionConfig(per_rank=1, queue=1, timeout=0.05, retry_after=2))
    held = [await admission.acquire(INFO, 1) for _ in range(2)]
    waiter = asyncio.create_task(admission.acquire(INFO, 1))
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as full:
        await admission.acquire(INFO, 1)
    assert full.value.status == 429
    assert full.value.headers() == {"Retry-After": "2"}
    with pytest.raises(ApiError) as late:
        await waiter
    assert late.value.status == 429
    assert "0.05" in late.value.message
    for permit in held:
        permit.release()
    assert (admission.in_use, admission.waiting) == (0, 0)


async def test_cancelled_waiters_leave_nothing_and_the_heap_stays_bounded() -> None:
    admission = Admission(AdmissionConfig(per_rank=1, queue=50, timeout=5))
    held = [await admission.acquire(INFO, 1) for _ in range(2)]
    for _ in range(20):
        tasks = [asyncio.create_task(admission.acquire(INFO, 1)) for _ in range(40)]
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert admission.waiting == 0
    assert len(admission._heap) <= 2 * 64 + 40
    for permit in held:
        permit.release()
    assert admission.in_use == 0


async def test_weight_is_clamped_and_heavy_requests_wait_their_turn() -> None:
    admission = Admission(AdmissionConfig(per_rank=2, queue=4, timeout=5))
    big = await admission.acquire(INFO, 99)
    assert big.weight == 4
    small = asyncio.create_task(admission.acquire(INFO, 1))
    await asyncio.sleep(0)
    assert admission.waiting == 1
    big.release()
    (await small).release()
    assert admission.in_use == 0


async def test_close_refuses_waiters_and_newcomers_with_503() -> None:
    admission = Admission(AdmissionConfig(per_rank=1, queue=4, timeout=5))
    held = [await admission.acquire(INFO, 1) for _ in range(2)]
    waiter = asyncio.create_task(admission.acquire(INFO, 1))
    await asyncio.sleep(0)
    admission.close()
    with pytest.raises(ApiError) as refused:
        await waiter
    assert refused.value.status == 503
    with pytest.raises(ApiError):
        await admission.acquire(INFO, 1)
    for permit in held:
        permit.release()
    assert (admission.in_use, admission.waiting) == (0, 0)
