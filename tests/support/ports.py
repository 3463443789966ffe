"""Loopback port allocation for servers started by tests.

Ports come from below the kernel's ephemeral range, never from it: a port the kernel handed
out for ``bind(0)`` is also one it may hand to any outgoing connection's source port (a gRPC
channel, an HTTP client, vLLM's own sockets) between this check and the server's bind, which
made servers fail with "address already in use" now and then on a busy run.
"""

from __future__ import annotations

import os
import random
import socket
from collections import deque
from pathlib import Path

_LOWEST = 10_000
_DEFAULT_EPHEMERAL = (32_768, 60_999)
_TRIES = 1_000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _band() -> tuple[int, int]:
    """The ports this process may pick from: below the ephemeral range, and under pytest-xdist
    a slice of it of this worker's own, so that two workers never pick the same port between
    one's check and its bind."""
    low, high = _ephemeral_range()
    low, high = (_LOWEST, low - 1) if low - _LOWEST >= 4_096 else (high + 1, 65_535)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and worker[2:].isdigit() and workers > 1:
        width = (high - low + 1) // workers
        low += int(worker[2:]) % workers * width
        high = low + width - 1
    return low, high


_RANDOM = random.Random()
_BAND = _band()
# Ports handed out lately, not handed out again until this many more have been.
_RECENT: deque[int] = deque(maxlen=1024)
_HANDED: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def candidate_port() -> int:
    """A random port of the band tests allocate from (below the ephemeral range), not
    checked: for a caller that binds and holds its picks itself."""
    low, high = _BAND
    return _RANDOM.randint(low, high)


def free_port() -> int:
    return free_port_range(1)


def free_port_range(count: int) -> int:
    """Return a base port such that ``base .. base+count-1`` are all free right now, and none
    was handed out lately.

    KV-event publishers bind ``base + rank``, so consecutive ports are needed. A port handed
    out is free but not yet bound: a test that asks for its engine's gRPC port and then its
    KV-event ports must not get the same port twice, or whichever binds second fails.
    """
    low, high = _BAND
    for _ in range(_TRIES):
        base = _RANDOM.randint(low, high - count + 1)
        ports = range(base, base + count)
        if not _HANDED.isdisjoint(ports):
            continue
        if all(_bindable(port) for port in ports):
            for port in ports:
                if len(_RECENT) == _RECENT.maxlen:
                    _HANDED.discard(_RECENT[0])
                _RECENT.append(port)
                _HANDED.add(port)
            return base
    raise RuntimeError(f"no run of {count} free loopback ports found in {low}-{high}")
