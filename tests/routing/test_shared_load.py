"""Load shared between worker processes: the board itself, trackers on different rows, and
routers that see each other's requests (in this process and across a real process boundary).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.base import RouteDecision
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.load import LoadTracker
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.routing.shared_load import SharedLoadBoard
from tests.routing.conftest import engine_info, prepared

WORKERS = 2


@pytest.fixture
def board() -> Iterator[SharedLoadBoard]:
    created = SharedLoadBoard.create(WORKERS, max_ranks=8)
    yield created
    created.close()


def _attach(board: SharedLoadBoard, worker: int) -> SharedLoadBoard:
    return SharedLoadBoard.attach(board.name, WORKERS, worker, max_ranks=8)


def test_rows_are_private_and_sums_are_shared(board: SharedLoadBoard) -> None:
    one = _attach(board, 1)
    try:
        board.add(3, 2, 100, 0)
        one.add(3, 1, 0, 40)
        one.add(9, 5, 5, 5)  # beyond max_ranks: ignored, never out of bounds
        assert board.totals(3) == (3, 100, 40)
        out = [[0, 0], [0, 0], [0, 0]]
        board.others((3, 0), out)
        assert out == [[1, 0], [0, 0], [40, 0]]
        one.others((3, 0), out)
        assert out == [[2, 0], [100, 0], [0, 0]]
        board.clear(1)
        assert board.totals(3) == (2, 100, 0)
    finally:
        one.close()


def test_bad_shapes_are_refused(board: SharedLoadBoard) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SharedLoadBoard.create(0)
    with pytest.raises(ValueError, match="out of range"):
        _attach(board, WORKERS)
    with pytest.raises(ValueError, match="smaller than its table"):
        SharedLoadBoard.attach(board.name, WORKERS + 4, 0, max_ranks=8)


def test_trackers_on_two_rows_see_each_other(board: SharedLoadBoard) -> None:
    other = _attach(board, 1)
    try:
        mine = LoadTracker((8, 8), board, (4, 5))
        theirs = LoadTracker((8, 8), other, (4, 5))
        ticket = theirs.admit(1, _decision(5), 30, 50)
        mine.sync()
        assert (mine.in_flight, mine.prefill_tokens, mine.decode_tokens) == (
            [0, 1],
            [0, 30],
            [0, 0],
        )
        ticket.first_token()
        own = mine.admit(0, _decision(4), 10, 10)
        mine.sync()
        assert (mine.in_flight, mine.prefill_tokens, mine.decode_tokens) == (
            [1, 1],
            [10, 0],
            [0, 50],
        )
        # Idempotent transitions leave the shared counts exact.
        ticket.finished()
        ticket.finished()
        own.finished()
        mine.sync()
        theirs.sync()
        assert mine.in_flight == theirs.in_flight == [0, 0]
        assert board.totals(4) == board.totals(5) == (0, 0, 0)
    finally:
        other.close()


def test_a_router_avoids_the_rank_another_worker_loaded(board: SharedLoadBoard) -> None:
    other = _attach(board, 1)
    try:
        first = build_router(RoutingConfig(policy="load"), CollectorRegistry(), board)
        second = build_router(RoutingConfig(policy="load"), CollectorRegistry(), other)
        alone = build_router(RoutingConfig(policy="load"), CollectorRegistry())
        for router in (first, second, alone):
            router.configure(engine_info((0, 1)))
        busy = [second.route(prepared(list(range(500)), f"busy{i}")) for i in range(2)]
        loaded = busy[0].decision.rank
        assert busy[1].decision.rank != loaded  # the second worker balances its own two
        busy[1].finished()
        # The first worker never routed anything, yet steers clear of the loaded rank...
        for i in range(3):
            ticket = first.route(prepared(list(range(1000 + i, 1100 + i)), f"new{i}"))
            assert ticket.decision.rank != loaded
            ticket.finished()
        # ...while a router without the board would have no reason to.
        picks = set()
        for i in range(4):
            ticket = alone.route(prepared(list(range(2000 + i, 2100 + i)), f"solo{i}"))
            picks.add(ticket.decision.rank)
            ticket.finished()
        assert picks == {0, 1}
        busy[0].finished()
        assert board.totals(0) == board.totals(1) == (0, 0, 0)
    finally:
        other.close()


def _hold_requests(
    name: str, started: multiprocessing.synchronize.Event, stop: multiprocessing.synchronize.Event
) -> None:
    board = SharedLoadBoard.attach(name, WORKERS, 1, max_ranks=8)
    tracker = LoadTracker((8, 8), board, (0, 1))
    tickets = [tracker.admit(0, _decision(0), 64, 64) for _ in range(3)]
    started.set()
    stop.wait(30)
    for ticket in tickets:
        ticket.finished()
    board.close()


def test_counts_cross_a_process_boundary(board: SharedLoadBoard) -> None:
    ctx = multiprocessing.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_requests, args=(board.name, started, stop))
    child.start()
    try:
        assert started.wait(60)
        tracker = LoadTracker((8, 8), board, (0, 1))
        tracker.sync()
        assert tracker.in_flight == [3, 0]
        assert tracker.prefill_tokens == [192, 0]
        stop.set()
        child.join(30)
        assert child.exitcode == 0
        tracker.sync()
        assert tracker.in_flight == [0, 0]
    finally:
        stop.set()
        child.join(5)
        if child.is_alive():
            child.kill()


def _decision(rank: int) -> RouteDecision:
    return RouteDecision(rank=rank)
