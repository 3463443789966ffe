"""A gateway run as its own process, as an operator runs it: knowing when it serves.

Its readiness is the state a test waits for; a process that exits meanwhile fails the wait at
once, with the end of its log when there is one, rather than at the bound.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.support.polling import wait_until


def answers_ready(http: httpx.Client, url: str) -> bool:
    """Whether the gateway at ``url`` answers ``/ready`` with 200; False while unreachable.

    One client serves every check: a fresh one costs tens of milliseconds of CPU, which a
    gateway starting on the same cores would wait for."""
    try:
        return http.get(f"{url}/ready").status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(
    url: str, process: subprocess.Popen[bytes], within: float, log: Path | None = None
) -> None:
    """Until the gateway ``process`` serving ``url`` is ready."""
    with httpx.Client(timeout=2) as http:

        def ready() -> bool:
            exited = f"the gateway exited with {process.poll()}{_tail(log)}"
            assert process.poll() is None, exited
            return answers_ready(http, url)

        wait_until(ready, within, lambda: f"{url} was not ready{_tail(log)}")


def _tail(log: Path | None) -> str:
    return f":\n{log.read_text(errors='replace')[-3000:]}" if log is not None else ""
