"""``rankgate serve --workers N``: N gateway processes serving one port.

One Python process tops out at one core, so a busy gateway runs several. This supervisor binds
the listening socket once and hands it to N spawned workers: the kernel keeps one accept queue,
and whichever worker is free takes the next connection, so a worker that dies loses only the
connections it had accepted. Each worker is a whole gateway with its own sidecar and gRPC
channels; what they must agree on lives outside them:

* per-rank load, in a :class:`~sidecar.routing.shared_load.SharedLoadBoard` (a row per
  worker), so that routing in one worker sees the requests the others have in flight;
* what each rank caches: the first worker alone subscribes to the KV events, and its index
  writes through to a table in shared memory (:mod:`sidecar.routing.shared_index`) that the
  others route on;
* metrics, in prometheus-client's multi-process directory, so any worker's ``/metrics``
  reports the whole gateway;
* the bundled mock engine (no ``--engine``), started once here so every worker routes to the
  same ranks.

A worker that crashes is restarted, after its load row is zeroed (its requests died with it)
and its live gauges are dropped; one that fails to start stops the whole gateway, since the
next try would fail the same way. SIGTERM or SIGINT is passed on to every worker, which
drains as a single gateway would.
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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from rankgate.app.access_log import configure_logging
from rankgate.app.demo import demo_engines
from rankgate.app.metrics import FLUSH_SIGNAL, MULTIPROC_ENV, SNAPSHOT_PREFIX
from rankgate.app.settings import GatewaySettings
from rankgate.sidecar import SharedLoadBoard

log = logging.getLogger(__name__)

BACKLOG = 2048
# Exit status of a worker whose startup failed (engine unreachable, bad tokenizer, ...).
STARTUP_FAILED = 3
# More restarts than this within RESTART_WINDOW_S means something is wrong beyond one crash.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
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
    settings: GatewaySettings, worker: int, sock: socket.socket, board_name: str
) -> None:
    """A worker process: one gateway on the supervisor's socket and its row of the board."""
    # A sibling's scrape may ask for this worker's metrics before its loop can answer.
    signal.signal(FLUSH_SIGNAL, signal.SIG_IGN)
    from rankgate.app.process import serve_worker

    configure_logging(settings.log_level, settings.log_format)
    board = SharedLoadBoard.attach(board_name, settings.workers, worker)
    try:
        code = serve_worker(settings, sockets=[sock], shared_load=board)
    finally:
        board.close()
    sys.exit(0 if code == 0 else STARTUP_FAILED)


@dataclass(slots=True)
class _Slot:
    index: int
    process: BaseProcess | None = None


class Supervisor:
    def __init__(self, settings: GatewaySettings, sock: socket.socket, board: SharedLoadBoard):
        self.settings = settings
        self.sock = sock
        self.board = board
        self.slots = [_Slot(i) for i in range(settings.workers)]
        self.stopping = False
        self.failed = False
        self._restarts: deque[float] = deque(maxlen=MAX_RESTARTS)
        self._context = multiprocessing.get_context("spawn")
        # The supervisor sleeps until a worker exits or stop() writes here; it never polls.
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._waker.setblocking(False)

    def start(self, slot: _Slot) -> None:
        process = self._context.Process(
            target=worker_main,
            args=(self.settings, slot.index, self.sock, self.board.name),
            name=f"rankgate-worker-{slot.index}",
        )
        process.start()
        slot.process = process

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
            for slot in self.slots:
                process = slot.process
                if process is None:
                    continue
                if process.exitcode is None:
                    alive += 1
                    continue
                code = self._reap(slot, process)
                if not self.stopping:
                    self._replace(slot, code)
                    if slot.process is not None:
                        alive += 1
            if self.stopping:
                if alive == 0:
                    break
                if deadline is None:
                    deadline = time.monotonic() + STOP_TIMEOUT_S
                elif time.monotonic() > deadline:
                    self._kill_all()
            self._sleep(deadline)
        return 1 if self.failed else 0

    def _sleep(self, deadline: float | None) -> None:
        """Until a worker exits, stop() is called, or the drain deadline (then every
        ``POLL_S``) passes."""
        waiting: list[int | socket.socket] = [self._wake]
        waiting += [slot.process.sentinel for slot in self.slots if slot.process is not None]
        timeout = None if deadline is None else max(POLL_S, deadline - time.monotonic())
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
        self.board.clear(slot.index)
        if process.pid is not None:
            _mark_dead(process.pid)
        process.close()
        return code

    def _replace(self, slot: _Slot, code: int) -> None:
        if code == STARTUP_FAILED:
            log.error("worker %d failed to start; stopping the gateway", slot.index)
            self.failed = True
            self.stop()
            return
        now = time.monotonic()
        if len(self._restarts) == MAX_RESTARTS and now - self._restarts[0] < RESTART_WINDOW_S:
            log.error(
                "workers died %d times within %.0f s; stopping the gateway",
                MAX_RESTARTS,
                RESTART_WINDOW_S,
            )
            self.failed = True
            self.stop()
            return
        self._restarts.append(now)
        log.warning("worker %d exited with status %d; starting a new one", slot.index, code)
        self.start(slot)

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
    try:
        with _metrics_directory(), demo_engines(settings) as serving:
            supervisor = Supervisor(serving, sock, board)
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
        sock.close()


def _handler(supervisor: Supervisor) -> Callable[[int, FrameType | None], None]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        supervisor.stop()

    return on_signal
