"""The one fan-in of the generation path: order of arrival, errors, early exit, renumbering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from rankgate.sidecar import merge_batch
from rankgate.sidecar.fan_in import FirstDone, interleave
from rankgate.sidecar.types import Delta


class Source:
    """Yields its items when released, one release per item; records being closed."""

    def __init__(self, items: list[str]) -> None:
        self.items = items
        self.gate = asyncio.Queue[None]()
        self.closed = False

    async def run(self) -> AsyncGenerator[str, None]:
        try:
            for item in self.items:
                await self.gate.get()
                if item == "boom":
                    raise RuntimeError("boom")
                yield item
        finally:
            self.closed = True


async def test_first_done_hands_on_futures_in_completion_order_and_sees_later_additions() -> None:
    loop = asyncio.get_running_loop()
    a, b, c = loop.create_future(), loop.create_future(), loop.create_future()
    pending: dict[asyncio.Future[int], str] = {a: "a", b: "b"}
    seen: list[str] = []
    b.set_result(2)
    async for _future, key in FirstDone(pending):
        seen.append(key)
        if key == "b":
            pending[c] = "c"
            c.set_result(3)
        elif key == "c":
            a.set_result(1)
    assert seen == ["b", "c", "a"]
    assert pending == {}


async def test_first_done_skips_a_future_the_caller_gave_up() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    pending: dict[asyncio.Future[int], str] = {a: "a", b: "b"}
    a.set_result(1)
    b.set_result(2)
    seen = []
    async for _, key in FirstDone(pending):
        seen.append(key)
        pending.clear()
    assert len(seen) == 1


async def test_interleave_yields_each_item_as_its_source_produces_it() -> None:
    first, second = Source(["a1", "a2"]), Source(["b1"])
    merged = interleave([first.run(), second.run()])
    second.gate.put_nowait(None)
    assert await anext(merged) == (1, "b1")
    first.gate.put_nowait(None)
    assert await anext(merged) == (0, "a1")
    first.gate.put_nowait(None)
    assert await anext(merged) == (0, "a2")
    with pytest.raises(StopAsyncIteration):
        await anext(merged)
    assert first.closed
    assert second.closed


async def test_one_failing_source_ends_all_and_closes_the_others() -> None:
    good, bad = Source(["a1", "a2"]), Source(["boom"])
    merged = interleave([good.run(), bad.run()])
    bad.gate.put_nowait(None)
    with pytest.raises(RuntimeError, match="boom"):
        await anext(merged)
    assert good.closed


async def test_closing_early_cancels_pending_reads_and_closes_every_source() -> None:
    first, second = Source(["a1", "a2"]), Source(["b1"])
    merged = interleave([first.run(), second.run()])
    first.gate.put_nowait(None)
    assert await anext(merged) == (0, "a1")
    await merged.aclose()
    assert first.closed
    assert second.closed


async def test_merge_batch_numbers_request_k_choice_i_as_k_times_n_plus_i() -> None:
    async def request(choices: int) -> AsyncGenerator[Delta, None]:
        for index in range(choices):
            yield Delta(index=index, text="x")

    deltas = [d async for d in merge_batch([request(2), request(2), request(2)], 2)]
    assert sorted(d.index for d in deltas) == [0, 1, 2, 3, 4, 5]
