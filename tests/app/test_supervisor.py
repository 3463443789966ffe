"""The ``--workers`` supervisor's restart policy, with worker doubles (forked by a fork
server, for speed, and never from this process, whose gRPC threads a fork would break; the
gateway spawns its workers): crashing workers are restarted with growing pauses while another
serves, and the gateway stops only when no worker can serve, saying why."""

from __future__ import annotations

import logging
import multiprocessing
import socket
import threading
from collections.abc import Iterator

import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.serving import workers
from rankgate.app.serving.workers import (
    BACKOFF_S,
    GIVE_UP,
    MAX_BACKOFF_S,
    STABLE_S,
    Supervisor,
    _Slot,
    listen,
)
from rankgate.sidecar import SharedLoadBoard
from tests.app.worker_doubles import never_starts, second_keeps_crashing
from tests.support.polling import wait_until


@pytest.fixture(scope="module", autouse=True)
def _fork_server() -> None:
    multiprocessing.get_context("forkserver").set_forkserver_preload(["tests.app.worker_doubles"])


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[socket.socket, SharedLoadBoard]]:
    # Short pauses: the policy, not its clock, is under test.
    monkeypatch.setattr(workers, "BACKOFF_S", 0.01)
    sock = listen("127.0.0.1", 0)
    board = SharedLoadBoard.create(2)
    try:
        yield sock, board
    finally:
        board.close()
        sock.close()


def test_a_worker_that_keeps_crashing_is_restarted_while_another_serves(parts) -> None:
    sock, board = parts
    supervisor = Supervisor(
        GatewaySettings(workers=2), sock, board, second_keeps_crashing, start_method="forkserver"
    )
    outcome: list[int] = []
    runner = threading.Thread(target=lambda: outcome.append(supervisor.run()), daemon=True)
    runner.start()
    try:
        crashing, serving = supervisor.slots[1], supervisor.slots[0]
        wait_until(
            lambda: crashing.failures > GIVE_UP or not runner.is_alive(),
            60,
            lambda: f"the crashing worker was restarted {crashing.failures} times",
        )
        assert runner.is_alive(), "the supervisor gave up while a worker served"
        assert serving.process is not None
        assert serving.process.exitcode is None
        assert serving.failures == 0
        assert not supervisor.failed
    finally:
        supervisor.stop()
        runner.join(30)
        supervisor.close()
    assert outcome == [0]


def test_with_no_worker_able_to_start_the_gateway_stops_and_says_why(
    parts, caplog: pytest.LogCaptureFixture
) -> None:
    sock, board = parts
    supervisor = Supervisor(
        GatewaySettings(workers=2), sock, board, never_starts, start_method="forkserver"
    )
    with caplog.at_level(logging.ERROR, logger="rankgate.app.serving.workers"):
        status = supervisor.run()
    supervisor.close()
    assert status == 1
    assert all(slot.failures >= GIVE_UP for slot in supervisor.slots)
    (message,) = [r.getMessage() for r in caplog.records if "no worker can serve" in r.getMessage()]
    assert f"last statuses {workers.STARTUP_FAILED}, {workers.STARTUP_FAILED}" in message


def test_the_pause_doubles_with_each_exit_in_a_row_and_a_stable_run_resets_it() -> None:
    slot = _Slot(0)
    pauses = [slot.exited(1, slot.started) for _ in range(12)]
    assert pauses[:4] == [0.0, BACKOFF_S, 2 * BACKOFF_S, 4 * BACKOFF_S]
    assert pauses == sorted(pauses)
    assert pauses[-1] == MAX_BACKOFF_S
    assert slot.exited(1, slot.started + STABLE_S) == 0.0
