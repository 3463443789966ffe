"""The KV index's masks in shared memory: the table against a dict, the index writing through to
it, and readers following the intake worker's table from generation to generation."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.index import DEVICE, OFFLOADED, EventIndex, match_masks
from rankgate.sidecar.routing.policies import KvRouter, build_router
from rankgate.sidecar.routing.shared_index import (
    MAX_SLOTS,
    MIN_ENTRIES,
    SharedKvReader,
    SharedKvTable,
    table_entries,
    table_name,
)
from rankgate.sidecar.routing.shared_load import SharedLoadBoard
from rankgate.sidecar.types import KvEventSource
from tests.routing.conftest import engine_info

_names = iter(range(1_000_000))


@pytest.fixture
def board() -> Iterator[SharedLoadBoard]:
    created = SharedLoadBoard.create(2, max_ranks=8)
    yield created
    created.close()


def _table(board: SharedLoadBoard, slots: int = 4, max_keys: int = 10) -> SharedKvTable:
    return SharedKvTable.create(table_name(board, 1000 + next(_names)), slots, max_keys)


# Keys that share their low bits collide in a small table: runs, wrap-around and shifts.
KEYS = st.sampled_from([i * MIN_ENTRIES + home for i in range(-3, 4) for home in (0, 1, 2, 1023)])
OPS = st.lists(st.tuples(KEYS, st.sampled_from((DEVICE, OFFLOADED)), st.integers(0, 15)))


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_the_table_agrees_with_a_dict(ops: list[tuple[int, int, int]]) -> None:
    name = f"rgkv_test_{next(_names)}"
    table = SharedKvTable.create(name, 4, 10)
    reader = SharedKvTable.attach(name)
    try:
        assert table.entries == MIN_ENTRIES
        model: dict[int, list[int]] = {}
        for key, tier, mask in ops:
            table.set(key, tier, mask)
            masks = model.setdefault(key, [0, 0])
            masks[tier] = mask
            if masks == [0, 0]:
                del model[key]
            for known in {k for k, _, _ in ops}:
                assert reader.get(known) == tuple(model.get(known, (0, 0))), (known, ops)
            assert len(reader) == len(model)
    finally:
        reader.close()
        table.close()


def test_entries_keep_the_load_at_half() -> None:
    assert table_entries(0) == MIN_ENTRIES
    assert table_entries(512) == MIN_ENTRIES
    assert table_entries(513) == 2 * MIN_ENTRIES
    assert table_entries(100_000) == 262_144


def test_bad_tables_are_refused(board: SharedLoadBoard) -> None:
    with pytest.raises(ValueError, match="1 to 63 ranks"):
        _table(board, slots=MAX_SLOTS + 1)
    with pytest.raises(ValueError, match="not a KV table"):
        SharedKvTable.attach(board.name)


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(("store", "remove", "clear")),
            st.integers(0, 2),
            st.sampled_from((DEVICE, OFFLOADED)),
            st.integers(0, 11),
            st.integers(0, 5),
        ),
        max_size=60,
    )
)
def test_an_index_writes_every_change_through(ops: list[tuple[str, int, int, int, int]]) -> None:
    name = f"rgkv_test_{next(_names)}"
    # Capacities small enough that stores evict.
    table = SharedKvTable.create(name, 3, 3 * (4 + 2))
    index = EventIndex([4, 4, 4], [2, 2, 2], table)
    try:
        for op, slot, tier, block, key in ops:
            if op == "store":
                index.store(slot, tier, block, key * 7919 - 20_000)
            elif op == "remove":
                index.remove(slot, tier, block)
            else:
                index.clear(slot)
        keys = set(index.device) | set(index.offloaded) | {k * 7919 - 20_000 for k in range(6)}
        for key in keys:
            assert table.get(key) == (index.device.get(key, 0), index.offloaded.get(key, 0))
        for slot in range(3):
            assert table.size(slot, DEVICE) == index.size(slot)
            assert table.size(slot, OFFLOADED) == index.size(slot, OFFLOADED)
        prompt = [k * 7919 - 20_000 for k in range(6)]
        assert table.match(prompt) == match_masks(prompt, 3, index.device, index.offloaded)
    finally:
        table.close()


def _kv_router(board: SharedLoadBoard | None, ranks: tuple[int, ...] = (0, 1)) -> KvRouter:
    router = build_router(RoutingConfig(), CollectorRegistry(), board)
    assert isinstance(router, KvRouter)
    # A source that is never served: configuring only decides who owns the intake.
    sources = [KvEventSource(rank, f"tcp://127.0.0.1:{1 + rank}", None, "kv") for rank in ranks]
    router.configure(engine_info(ranks, sources=sources))
    return router


async def test_only_the_first_worker_runs_an_intake(board: SharedLoadBoard) -> None:
    second_board = SharedLoadBoard.attach(board.name, 2, 1, max_ranks=8)
    first, second = _kv_router(board), _kv_router(second_board)
    try:
        assert first.view.intake is not None
        assert first.view.events is not None
        assert first.view.events.mirror is first.view.shared_table
        assert second.view.intake is None
        assert second.view.events is None
        assert board.kv_generation == 1
        first.view.events.store(1, DEVICE, "block", 42)
        assert second.view.match([42]) is not None
        assert second.view.match([42]).device == [0, 1]  # type: ignore[union-attr]
        assert second._index_sizes(1) == (1, 0, 0)
        # A topology change makes a new table; the reader follows it on its next look.
        first.configure(engine_info((0, 1), sources=_sources(), kv_blocks=50))
        assert board.kv_generation == 3  # one past the old table's, which is gone
        assert second.view.match([42]).device == [0, 0]  # type: ignore[union-attr]
        await first.close()
        # The table went with its writer: the reader routes on predictions alone meanwhile.
        assert second.view.match([42]) is None
    finally:
        await first.close()
        await second.close()
        second_board.close()


async def test_a_reader_of_other_ranks_ignores_the_table(board: SharedLoadBoard) -> None:
    second_board = SharedLoadBoard.attach(board.name, 2, 1, max_ranks=8)
    first, second = _kv_router(board), _kv_router(second_board, ranks=(0, 1, 2))
    try:
        assert second.view.match([1]) is None
    finally:
        await first.close()
        await second.close()
        second_board.close()


def _sources() -> list[KvEventSource]:
    return [KvEventSource(rank, f"tcp://127.0.0.1:{1 + rank}", None, "kv") for rank in (0, 1)]


def test_a_single_worker_keeps_its_index_to_itself() -> None:
    alone = SharedLoadBoard.create(1, max_ranks=8)
    try:
        router = _kv_router(alone)
        assert router.view.shared_table is None
        assert router.view.events is not None
        assert router.view.events.mirror is None
        assert alone.kv_generation == 0
    finally:
        alone.close()


def _read_in_a_child(board_name: str, out: Any) -> None:
    board = SharedLoadBoard.attach(board_name, 2, 1, max_ranks=8)
    reader = SharedKvReader(board, 2)
    table = reader.table()
    out.put(None if table is None else table.match([7, 8, 9]).device)
    reader.close()
    board.close()


def test_a_reader_in_another_process_sees_the_writes(board: SharedLoadBoard) -> None:
    table = SharedKvTable.create(table_name(board, 1), 2, 10)
    try:
        for key in (7, 8):
            table.set(key, DEVICE, 0b10)
        table.set(7, DEVICE, 0b11)
        board.kv_generation = 1
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_read_in_a_child, args=(board.name, out))
        child.start()
        assert out.get(timeout=60) == [1, 2]
        child.join(30)
        assert child.exitcode == 0
    finally:
        table.close()
