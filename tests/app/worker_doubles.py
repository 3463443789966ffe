"""Worker processes for the supervisor's tests: what a real worker does at its exit, without
serving anything (the spawned child imports this module by name)."""

from __future__ import annotations

import signal
import socket
import sys

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.serving.workers import STARTUP_FAILED


def never_starts(
    settings: GatewaySettings, worker: int, sock: socket.socket, boards: tuple[str, ...]
) -> None:
    sys.exit(STARTUP_FAILED)


def second_keeps_crashing(
    settings: GatewaySettings, worker: int, sock: socket.socket, boards: tuple[str, ...]
) -> None:
    """Worker 0 serves until SIGTERM; worker 1 dies as soon as it starts."""
    if worker == 1:
        sys.exit(1)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.sigwait({signal.SIGTERM})
