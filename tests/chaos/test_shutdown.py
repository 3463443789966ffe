"""SIGTERM on a real ``rankgate serve`` process (bundled mock engine): it stops accepting,
lets an in-flight stream that fits the grace period finish, ends the one that does not with an
error event and ``[DONE]`` (not a cut connection), and exits."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.app.processes import wait_ready
from tests.chaos.harness import raw_stream_request
from tests.chaos.test_clients import read_events
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
GRACE = 2.0
pytestmark = pytest.mark.timeout(120)


def read_to_end(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_sigterm_drains_then_ends_the_rest_cleanly() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankgate.app.cli", "serve", "--port", str(port),
         "--mock-speed", "1", "--shutdown-grace", str(GRACE), "--log-level", "warning"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, 60)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

        def body(tokens: int) -> dict[str, object]:
            return {
                "model": model,
                "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": tokens,
                "ignore_eos": True,
            }

        short = raw_stream_request(port, body(120))
        long = raw_stream_request(port, body(3000))
        for sock in (short, long):
            read_events(sock, 1)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        with ThreadPoolExecutor(2) as pool:
            short_out, long_out = pool.map(read_to_end, (short, long))
            long_ended = time.monotonic() - signalled
        refused = False
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            refused = True
        assert refused, "the server still accepts connections while shutting down"

        assert short_out.count(b"data: [DONE]") == 1
        assert b'"finish_reason":"length"' in short_out
        assert b'"error"' not in short_out

        assert long_out.count(b"data: [DONE]") == 1, long_out[-400:]
        assert b"shutting down" in long_out
        assert b'"finish_reason":"length"' not in long_out
        assert GRACE - 0.2 <= long_ended < GRACE + 4

        # uvicorn re-raises the signal once its shutdown is complete, so a supervisor sees
        # "terminated by SIGTERM" rather than a crash.
        assert proc.wait(15) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
