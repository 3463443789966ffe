"""Per-rank admission on its own: slots from capacity, pinned and unpinned waiters, priority,
deadlines, cancellation, shutdown, resizing, and no bookkeeping left behind."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from rankgate.sidecar.admission import GROUP, Admission, AdmissionConfig
from rankgate.sidecar.errors import EngineUnavailable, GatewayOverloaded
from rankgate.sidecar.types import RankCapacity
from tests.app.scripted import scripted_info
from tests.conftest import TINY_TOKENIZER

INFO = scripted_info(TINY_TOKENIZER)  # two ranks, max_running_requests 8 each


def admission(per_rank: int = 1, queue: int = 16, timeout: float = 5.0, **kw: float) -> Admission:
    gate = Admission(AdmissionConfig(per_rank=per_rank, queue=queue, timeout=timeout, **kw))
    gate.configure(INFO)
    return gate


def settled(gate: Admission) -> tuple[int, int, int]:
    return gate.in_use, gate.waiting, gate.free


async def turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_limits_per_rank_from_capacity_and_workers() -> None:
    assert AdmissionConfig().limits(INFO) == {0: 16, 1: 16}
    assert AdmissionConfig(per_rank=3).limits(INFO) == {0: 3, 1: 3}
    assert AdmissionConfig().limits(INFO, workers=3) == {0: 6, 1: 6}
    assert AdmissionConfig(per_rank=1).limits(INFO, workers=4) == {0: 1, 1: 1}
    uneven = msgspec.structs.replace(
        INFO, capacity=(RankCapacity(0, 10, 100), RankCapacity(1, 10, 50))
    )
    assert AdmissionConfig().limits(uneven) == {0: 200, 1: 100}
    gate = Admission()
    gate.configure(uneven, group=True)
    assert gate.limit == {GROUP: 300}
    assert gate.key_of(1) == GROUP
    assert gate.key_of(None) == GROUP


def test_taking_and_giving_keep_free_and_full_exact() -> None:
    gate = admission(per_rank=2)
    assert (gate.free, gate.full) == (4, set())
    gate.take(0)
    gate.take(0)
    assert (gate.free, gate.full) == (2, {0})
    assert not gate.fits(0, 1)
    assert gate.fits(1, 2)
    assert gate.fits(None, 2)
    gate.take(0)  # a caller that insists goes over the limit
    assert (gate.free, gate.used[0]) == (2, 3)
    gate.give(0)
    assert (gate.free, gate.full) == (2, {0})
    gate.give(0)
    assert (gate.free, gate.full) == (3, set())
    gate.give(0)
    assert settled(gate) == (0, 0, 4)


async def test_a_pinned_waiter_takes_only_its_own_rank() -> None:
    gate = admission()
    gate.take(0)
    gate.take(1)
    pinned = asyncio.create_task(gate.wait(0, 1, 0))
    anywhere = asyncio.create_task(gate.wait(None, 1, 0))
    await turn()
    assert gate.waiting == 2
    gate.give(1)  # rank 1 frees: the unpinned waiter gets it, never the one pinned to rank 0
    await turn()
    assert anywhere.done()
    assert not pinned.done()
    gate.take(1)  # the woken waiter takes its slot synchronously, as the sidecar does
    gate.settle()
    gate.give(0)
    await turn()
    assert pinned.done()
    gate.take(0)
    gate.give(0)
    gate.give(1)
    assert settled(gate) == (0, 0, 2)


async def test_a_grant_that_fits_takes_its_slots_without_waiting() -> None:
    gate = admission(per_rank=2)
    async with gate.grant(None, 2, 0) as grant:
        assert grant.take(0) == 0
        assert grant.take(None) is None  # a stream vLLM places itself holds no slot
        assert grant.take(1) == 1
    assert (gate.waiting, gate.used) == (0, {0: 1, 1: 1})
    gate.give(0)
    gate.give(1)
    assert settled(gate) == (0, 0, 4)


async def test_a_grant_waits_then_settles_what_its_body_left_free() -> None:
    gate = admission()
    gate.take(0)
    gate.take(1)
    woken: list[str] = []

    async def request(name: str, weight: int, takes: int) -> None:
        async with gate.grant(None, weight, 0) as grant:
            woken.append(name)
            for _ in range(takes):
                grant.take(0 if gate.room(0) > 0 else 1)

    # "pair" needs both slots but its body launches only one; "next" must get the other.
    pair = asyncio.create_task(request("pair", 2, 1))
    after = asyncio.create_task(request("next", 1, 1))
    await turn()
    assert gate.waiting == 2
    gate.give(0)
    await turn()
    assert woken == []  # one slot is not enough for the pair, and the next may not overtake
    gate.give(1)
    await asyncio.gather(pair, after)
    assert woken == ["pair", "next"]
    assert (gate.in_use, gate.waiting, gate.free) == (2, 0, 0)


async def test_a_grant_whose_body_fails_hands_its_slots_on() -> None:
    gate = admission()
    gate.take(0)
    gate.take(1)

    async def failing() -> None:
        async with gate.grant(0, 1, 0):
            raise RuntimeError("the router failed")

    first = asyncio.create_task(failing())
    second = asyncio.create_task(gate.wait(0, 1, 0))
    await turn()
    gate.give(0)
    with pytest.raises(RuntimeError):
        await first
    await asyncio.wait_for(second, 1)
    gate.give(1)
    assert settled(gate) == (0, 0, 2)


async def test_a_pinned_waiter_does_not_hold_up_others() -> None:
    gate = admission()
    gate.take(0)
    pinned = asyncio.create_task(gate.wait(0, 1, -10))
    await turn()
    # Rank 1 is free: an unpinned newcomer goes at once although a better one waits for 0.
    assert gate.fits(None, 1)
    assert gate.fits(1, 1)
    pinned.cancel()
    await asyncio.gather(pinned, return_exceptions=True)
    gate.give(0)
    assert settled(gate) == (0, 0, 2)


async def test_priority_then_arrival_across_pinned_and_unpinned() -> None:
    gate = admission(queue=10)
    gate.take(0)
    gate.take(1)
    order: list[str] = []

    async def wait(name: str, key: int | None, priority: int) -> None:
        await gate.wait(key, 1, priority)
        order.append(name)
        gate.take(key if key is not None else (0 if gate.room(0) > 0 else 1))
        gate.settle()

    tasks = []
    for name, key, priority in (
        ("late", None, 5),
        ("first", 0, -1),
        ("second", None, 0),
        ("third", 1, 0),
    ):
        tasks.append(asyncio.create_task(wait(name, key, priority)))
        await turn()
    assert gate.waiting == 4
    for rank in (0, 1, 0, 1):
        gate.give(rank)
        await turn()
    await asyncio.gather(*tasks)
    # The second slot on rank 0 goes to "late", the only waiter that may use it: "third"
    # outranks it but waits for rank 1, which frees last.
    assert order == ["first", "second", "late", "third"]
    for rank in (0, 1):
        gate.give(rank)
    assert settled(gate) == (0, 0, 2)


async def test_full_queue_and_deadline_are_gateway_overloaded() -> None:
    gate = admission(queue=1, timeout=0.05, retry_after=2)
    gate.take(0)
    gate.take(1)
    waiter = asyncio.create_task(gate.wait(None, 1, 0))
    await turn()
    with pytest.raises(GatewayOverloaded) as full:
        await gate.wait(0, 1, 0)
    assert full.value.retry_after == 2
    with pytest.raises(GatewayOverloaded) as late:
        await waiter
    assert "0.05" in late.value.message
    assert (gate.refused_full, gate.refused_late) == (1, 1)
    gate.give(0)
    gate.give(1)
    assert settled(gate) == (0, 0, 2)


async def test_cancelled_waiters_leave_nothing_and_the_heaps_stay_bounded() -> None:
    gate = admission(queue=50)
    gate.take(0)
    gate.take(1)
    for round_ in range(20):
        key = (None, 0, 1)[round_ % 3]
        tasks = [asyncio.create_task(gate.wait(key, 1, 0)) for _ in range(40)]
        await turn()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert gate.waiting == 0
    held = len(gate._anywhere) + sum(len(heap) for heap in gate._pinned.values())
    assert held <= 2 * 64 + 40
    gate.give(0)
    gate.give(1)
    assert settled(gate) == (0, 0, 2)


async def test_the_fast_path_returns_once_the_waiters_are_gone() -> None:
    gate = admission()
    gate.take(0)
    gate.take(1)
    waiters = [asyncio.create_task(gate.wait(key, 1, 0)) for key in (0, None)]
    await turn()
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    gate.give(0)
    assert gate.fits(0, 1)
    assert gate.fits(None, 1)
    # A waiter granted and gone leaves no queue behind either.
    gate.take(0)
    granted = asyncio.create_task(gate.wait(0, 1, 0))
    await turn()
    gate.give(0)
    await granted
    gate.take(0)
    gate.give(0)
    assert gate.fits(0, 1)
    assert not gate._pinned
    gate.give(1)
    assert settled(gate) == (0, 0, 2)


async def test_a_granted_waiter_cancelled_before_it_runs_hands_its_slot_on() -> None:
    gate = admission()
    gate.take(0)
    gate.take(1)
    first = asyncio.create_task(gate.wait(None, 1, 0))
    second = asyncio.create_task(gate.wait(None, 1, 0))
    await turn()
    gate.give(0)  # granted to ``first``: reserved, so nobody else can take it meanwhile
    assert not gate.fits(None, 1)
    assert gate.used[0] == 1
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await turn()
    assert second.done()
    assert gate.waiting == 0
    gate.take(0)
    gate.give(0)
    gate.give(1)
    assert settled(gate) == (0, 0, 2)


async def test_a_heavy_request_waits_until_all_its_slots_are_free_at_once() -> None:
    gate = admission(per_rank=2)
    for rank in (0, 0, 1, 1):
        gate.take(rank)
    heavy = asyncio.create_task(gate.wait(None, 3, 0))
    await turn()
    gate.give(0)
    gate.give(1)
    await turn()
    assert not heavy.done()
    assert gate.free == 2
    gate.give(1)
    await turn()
    assert heavy.done()
    for rank in (0, 1, 1):
        gate.take(rank)
    gate.give(0)
    for rank in (0, 1, 1):
        gate.give(rank)
    assert settled(gate) == (0, 0, 4)
    # More than the pool can ever give is clamped to all of it.
    gate.take(0)
    huge = asyncio.create_task(gate.wait(None, 99, 0))
    await turn()
    gate.give(0)
    await turn()
    assert huge.done()
    assert gate.waiting == 0


async def test_growing_capacity_on_rediscovery_grants_waiters() -> None:
    gate = admission(per_rank=0)
    small = msgspec.structs.replace(INFO, capacity=(RankCapacity(0, 1, 1), RankCapacity(1, 1, 1)))
    gate.configure(small)
    assert gate.limit == {0: 2, 1: 2}
    for rank in (0, 0, 1, 1):
        gate.take(rank)
    waiter = asyncio.create_task(gate.wait(1, 1, 0))
    await turn()
    gate.configure(INFO)
    await turn()
    assert waiter.done()
    assert gate.limit == {0: 16, 1: 16}
    for rank in (0, 0, 1, 1):
        gate.give(rank)
    assert settled(gate) == (0, 0, 32)


async def test_close_refuses_waiters_and_newcomers() -> None:
    gate = admission()
    gate.take(0)
    gate.take(1)
    waiters = [asyncio.create_task(gate.wait(key, 1, 0)) for key in (None, 0)]
    await turn()
    gate.close(EngineUnavailable("the gateway is shutting down"))
    for waiter in waiters:
        with pytest.raises(EngineUnavailable):
            await waiter
    with pytest.raises(EngineUnavailable):
        await gate.wait(None, 1, 0)
    gate.give(0)
    gate.give(1)
    assert settled(gate) == (0, 0, 2)


def test_snapshot_reports_each_rank_and_the_anywhere_waiters() -> None:
    gate = admission(per_rank=2)
    gate.take(1)
    snaps = {snap.key: snap for snap in gate.snapshot()}
    assert set(snaps) == {0, 1}
    assert (snaps[1].limit, snaps[1].in_use, snaps[1].waiting) == (2, 1, 0)
