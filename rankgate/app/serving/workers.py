"""``rankgate serve --workers N``: N gateway processes serving one port.

One Python process tops out at one core, so a busy gateway runs several. This supervisor binds
the listening socket once and hands it to N spawned workers: the kernel keeps one accept queue,
and whichever worker is free takes the next connection, so a worker that dies loses only the
connections it had accepted. Each worker is a whole gateway with its own sidecar and gRPC
channels; what they must agree on lives outside them:

* per-rank load, in a :class:`~rankgate.sidecar.routing.shared_load.SharedLoadBoard` (a row per
  worker), so that routing in one worker sees the requests the others have in flight;
* what each rank caches: the first worker alone subscribes to the KV events, and its index
  writes through to a table in shared memory (:mod:`rankgate.sidecar.routing.shared_index`) that the
  others route on;
* metrics, in prometheus-client's multi-process directory, so any worker's ``/metrics``
  reports the whole gateway;
* the bundled mock engine (no ``--engine``), started once here so every worker routes to the
  same ranks.

A worker that exits is restarted, after its load row is zeroed (its requests died with it)
and its live gauges are dropped: at once the first time, then after a pause that doubles with
each exit in a row (0.5 s up to 30 s), the count starting over once a worker has lived
``STABLE_S``. Crashing workers thus never take down the ones that serve. The supervisor gives
up only when no worker is alive and every one has failed ``GIVE_UP`` times in a row without
a stable run (an engine that cannot be reached, a bad tokenizer), and says so with the last
exit statuses. SIGTERM or SIGINT is passed on to every worker, which drains as a single
gateway would.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Literal

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.observability.logs import configure_logging
from rankgate.app.observability.metrics import FLUSH_SIGNAL, MULTIPROC_ENV, SNAPSHOT_PREFIX
from rankgate.app.serving.demo import demo_engines
from rankgate.sidecar import SharedLoadBoard

log = logging.getLogger(__name__)

BACKLOG = 2048
# Exit status of a worker whose startup failed (engine unreachable, bad tokenizer, ...).
STARTUP_FAILED = 3
# A worker that lived this long ends its slot's run of failures.
STABLE_S = 30.0
# The pause before restarting a slot after its second exit in a row, doubling after each
# further one, up to the most.
BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
# Exits in a row, in every slot with none alive, after which no worker can serve.
GIVE_UP = 5
# How often the supervisor looks again at workers it has killed, until they are gone.
POLL_S = 0.2
# How long workers get to drain after SIGTERM before they are killed.
STOP_TIMEOUT_S = 90.0


def listen(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, shared by every worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def worker_main(
    settings: GatewaySettings, worker: int, sock: socket.socket, board_names: tuple[str, ...]
) -> None:
    """A worker process: one gateway on the supervisor's socket and its row of each board
    (the engine's, then under disaggregated serving the prefill engine's)."""
    # A sibling's scrape may ask for this worker's metrics before its loop can answer.
    signal.signal(FLUSH_SIGNAL, signal.SIG_IGN)
    from rankgate.app.serving.process import serve_worker

    configure_logging(settings.log_level, settings.log_format)
    boards = [SharedLoadBoard.attach(name, settings.workers, worker) for name in board_names]
    try:
        code = serve_worker(
            settings,
            sockets=[sock],
            shared_load=boards[0],
            prefill_load=boards[1] if len(boards) > 1 else None,
        )
    finally:
        for board in boards:
            board.close()
    sys.exit(0 if code == 0 else STARTUP_FAILED)


@dataclass(slots=True)
class _Slot:
    index: int
    process: BaseProcess | None = None
    started: float = 0.0
    # Exits in a row without a stable run, the last one's status, and when to start again.
    failures: int = 0
    last_status: int = 0
    restart_at: float | None = None

    def exited(self, status: int, now: float) -> float:
        """Record an exit; the pause before the next start."""
        if now - self.started >= STABLE_S:
            self.failures = 0
        self.failures += 1
        self.last_status = status
        if self.failures == 1:
            return 0.0
        return float(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (self.failures - 2)))


class Supervisor:
    def __init__(
        self,
        settings: GatewaySettings,
        sock: socket.socket,
        board: SharedLoadBoard,
        target: Callable[[GatewaySettings, int, socket.socket, tuple[str, ...]], None] = (
            worker_main
        ),
        start_method: Literal["spawn", "forkserver"] = "spawn",
        prefill_board: SharedLoadBoard | None = None,
    ):
        self.settings = settings
        self.sock = sock
        # The engine's board, then the prefill engine's under disaggregated serving.
        self.boards = [board] if prefill_board is None else [board, prefill_board]
        self.slots = [_Slot(i) for i in range(settings.workers)]
        self.stopping = False
        self.failed = False
        self.restarts = 0
        self._target = target
        # Spawned: a worker starts from a clean interpreter, not a copy of this one's threads.
        self._context: SpawnContext | ForkServerContext = (
            multiprocessing.get_context("forkserver")
            if start_method == "forkserver"
            else multiprocessing.get_context("spawn")
        )
        # The supervisor sleeps until a worker exits or stop() writes here; it never polls.
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._waker.setblocking(False)

    def start(self, slot: _Slot) -> None:
        process = self._context.Process(
            target=self._target,
            args=(self.settings, slot.index, self.sock, tuple(b.name for b in self.boards)),
            name=f"rankgate-worker-{slot.index}",
        )
        process.start()
        slot.process = process
        slot.started = time.monotonic()
        slot.restart_at = None

    def stop(self, *_: object) -> None:
        """Ask every worker to drain and exit (idempotent; safe in a signal handler)."""
        self.stopping = True
        with contextlib.suppress(OSError):  # full: a wake-up is already pending
            self._waker.send(b"\0")
        for slot in self.slots:
            process = slot.process
            if process is not None and process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    def run(self) -> int:
        for slot in self.slots:
            self.start(slot)
        log.info(
            "serving on %s with %d workers (pids %s)",
            _address(self.sock),
            len(self.slots),
            ", ".join(str(s.process.pid) for s in self.slots if s.process is not None),
        )
        deadline: float | None = None
        while True:
            alive = 0
            now = time.monotonic()
            for slot in self.slots:
                process = slot.process
                if process is None:
                    if not self.stopping and slot.restart_at is not None and now >= slot.restart_at:
                        self.restarts += 1
                        self.start(slot)
                        alive += 1
                    continue
                if process.exitcode is None:
                    alive += 1
                    continue
                code = self._reap(slot, process)
                if not self.stopping:
                    pause = slot.exited(code, now)
                    slot.restart_at = now + pause
                    log.warning(
                        "worker %d exited with status %d (%d in a row); starting a new one%s",
                        slot.index,
                        code,
                        slot.failures,
                        f" in {pause:g} s" if pause else "",
                    )
                    if pause == 0:
                        self.restarts += 1
                        self.start(slot)
                        alive += 1
            if not self.stopping and alive == 0 and self._hopeless():
                log.error(
                    "no worker can serve: every one of the %d exited %d times in a row (last "
                    "statuses %s); stopping the gateway",
                    len(self.slots),
                    GIVE_UP,
                    ", ".join(str(slot.last_status) for slot in self.slots),
                )
                self.failed = True
                self.stop()
            if self.stopping:
                if alive == 0:
                    break
                if deadline is None:
                    deadline = time.monotonic() + STOP_TIMEOUT_S
                elif time.monotonic() > deadline:
                    self._kill_all()
            self._sleep(deadline)
        return 1 if self.failed else 0

    def _hopeless(self) -> bool:
        return all(slot.process is None and slot.failures >= GIVE_UP for slot in self.slots)

    def _sleep(self, deadline: float | None) -> None:
        """Until a worker exits, stop() is called, a restart falls due, or the drain deadline
        (then every ``POLL_S``) passes."""
        waiting: list[int | socket.socket] = [self._wake]
        waiting += [slot.process.sentinel for slot in self.slots if slot.process is not None]
        due = [] if self.stopping else [s.restart_at for s in self.slots if s.restart_at]
        if deadline is not None:
            due.append(max(deadline, time.monotonic() + POLL_S))
        timeout = None if not due else max(0.0, min(due) - time.monotonic())
        if self._wake in wait(waiting, timeout):
            with contextlib.suppress(OSError):
                while self._wake.recv(64):
                    pass

    def close(self) -> None:
        self._wake.close()
        self._waker.close()

    def _reap(self, slot: _Slot, process: BaseProcess) -> int:
        """Forget a worker that exited; its exit status."""
        code = process.exitcode if process.exitcode is not None else -1
        slot.process = None
        for board in self.boards:
            board.clear(slot.index)
        if process.pid is not None:
            _mark_dead(process.pid)
        process.close()
        return code

    def _kill_all(self) -> None:
        for slot in self.slots:
            process = slot.process
            if process is not None and process.exitcode is None:
                log.warning("worker %d did not drain in time; killing it", slot.index)
                process.kill()


def _mark_dead(pid: int) -> None:
    directory = os.environ.get(MULTIPROC_ENV)
    if directory:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


@contextlib.contextmanager
def _metrics_directory() -> Iterator[str]:
    """prometheus-client's multi-process directory: the operator's (emptied of old files), or
    a private one removed on exit."""
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        for stale in [*Path(given).glob("*.db"), *Path(given).glob(f"{SNAPSHOT_PREFIX}*")]:
            stale.unlink()
        yield given
        return
    made = tempfile.mkdtemp(prefix="rankgate-metrics-")
    os.environ[MULTIPROC_ENV] = made
    try:
        yield made
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(made, ignore_errors=True)


def run_workers(settings: GatewaySettings) -> int:
    """Serve with ``settings.workers`` processes until SIGTERM/SIGINT; the exit status."""
    if settings.disaggregated and settings.prefill_engine is None:
        raise SystemExit(
            "--workers > 1 with --disaggregated needs --prefill-engine/--decode-engine"
        )
    try:
        sock = listen(settings.host, settings.port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return 1
    board = SharedLoadBoard.create(settings.workers)
    # Under disaggregated serving the prefill engine's ranks have a board of their own.
    prefill_board = SharedLoadBoard.create(settings.workers) if settings.split_serving else None
    try:
        with _metrics_directory(), demo_engines(settings) as serving:
            supervisor = Supervisor(serving, sock, board, prefill_board=prefill_board)
            previous = {
                sig: signal.signal(sig, _handler(supervisor))
                for sig in (signal.SIGTERM, signal.SIGINT)
            }
            try:
                return supervisor.run()
            finally:
                supervisor.stop()
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                supervisor.close()
    finally:
        board.close()
        if prefill_board is not None:
            prefill_board.close()
        sock.close()


def _handler(supervisor: Supervisor) -> Callable[[int, FrameType | None], None]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        supervisor.stop()

    return on_signal
