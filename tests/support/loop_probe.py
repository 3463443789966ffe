"""A concurrent ``/health`` poller: how long did the gateway's event loop keep clients waiting?

``/health`` does no work, so its latency is the time the loop took to get to it: a request
that holds the loop (a regex, a decode, a tokenizer call holding the GIL) shows up as one
long ``/health`` round trip. The poller runs on its own thread with its own keep-alive
connection, so the process under test is only ever asked for one small GET at a time, and it
samples the server's resident memory between polls when given its pid.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` from /proc (0 when it cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass
class ProbeResult:
    polls: int = 0
    failures: int = 0
    max_latency: float = 0.0
    baseline_rss: int = 0
    peak_rss: int = 0
    latencies: list[float] = field(default_factory=list)

    @property
    def rss_growth(self) -> int:
        return max(0, self.peak_rss - self.baseline_rss)


@contextmanager
def health_probe(
    base_url: str, *, interval: float = 0.01, timeout: float = 120.0, pid: int | None = None
) -> Iterator[ProbeResult]:
    """Poll ``GET /health`` every ``interval`` seconds while the block runs.

    A poll that fails (connection refused or reset) counts as a failure and as a latency of
    the time it took; the connection is then opened afresh.
    """
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    result = ProbeResult()
    if pid is not None:
        result.baseline_rss = result.peak_rss = rss_bytes(pid)
    stop = threading.Event()

    def poll() -> None:
        conn: http.client.HTTPConnection | None = None
        while not stop.is_set():
            started = time.perf_counter()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, port, timeout=timeout)
                conn.request("GET", "/health")
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    result.failures += 1
            except (OSError, http.client.HTTPException):
                result.failures += 1
                if conn is not None:
                    conn.close()
                conn = None
            latency = time.perf_counter() - started
            result.polls += 1
            result.latencies.append(latency)
            result.max_latency = max(result.max_latency, latency)
            if pid is not None:
                result.peak_rss = max(result.peak_rss, rss_bytes(pid))
            stop.wait(interval)
        if conn is not None:
            conn.close()

    thread = threading.Thread(target=poll, name="health-probe", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join(timeout + 5)
