"""Safe defaults through the command line: the demo engine, the standalone mock, the container.

A bare ``rankgate serve`` serves the bundled mock engine, says so in its log and /v1/models, and
opens nothing but loopback sockets (HTTP, gRPC and all the KV-event sockets); ``rankgate
mock-engine`` with no flags pairs with ``rankgate serve --engine`` as it is; with
``RANKGATE_REQUIRE_ENGINE`` (the container image's setting) a gateway without an engine exits
at once with a message naming ``RANKGATE_ENGINE``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from rankgate.app.routes.models import DEMO_OWNER
from tests.app.processes import wait_ready
from tests.support.polling import wait_until
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKGATE_")}
    return {**env, **extra}


@contextmanager
def process(argv: list[str], log: Path, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rankgate.app.cli", *argv],
            cwd=ROOT,
            env=_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def listening_addresses(pid: int) -> set[str]:
    """The local addresses of every TCP socket ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found: set[str] = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:
                continue
            raw, port = local.split(":")
            packed = bytes.fromhex(raw)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
            found.add(f"{socket.inet_ntop(family, words)}:{int(port, 16)}")
    return found


def chat(base: str, model: str, text: str = "hi") -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3},
        timeout=30,
    )


def test_a_bare_serve_is_a_loopback_demo_that_says_so(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with process(["serve", "--port", str(port), "--mock-speed", "0"], log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, 90, log)
        models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
        assert [m["owned_by"] for m in models] == [DEMO_OWNER]
        assert chat(base, models[0]["id"]).status_code == 200
        # The KV events still flow with the publishers connecting to the gateway's sockets.
        # Each chat is long enough to fill whole KV blocks, which is what the engine publishes;
        # another goes until the publishers' batches are counted.
        block = {"role": "user", "content": "a whole block of words " * 20}
        asked = {"model": models[0]["id"], "messages": [block], "max_tokens": 3}
        seen = [""]
        with httpx.Client(base_url=base, timeout=30) as http:

            def counted() -> bool:
                seen[0] = http.get("/metrics").text
                if "rankgate_kv_event_batches_total{" in seen[0]:
                    return True
                assert http.post("/v1/chat/completions", json=asked).status_code == 200
                return False

            wait_until(counted, 20, lambda: seen[0][-2000:])
        addresses = listening_addresses(proc.pid)
        # HTTP, the mock's gRPC port and the KV-event sockets (replay on the mock's side,
        # the publishers' targets on the gateway's): several, all on loopback.
        assert len(addresses) >= 4, addresses
        assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    assert "DEMO MODE" in log.read_text()


def test_the_standalone_mock_engine_needs_no_flags(tmp_path: Path) -> None:
    engine_port, port = free_port(), free_port()
    engine_log, log = tmp_path / "engine.log", tmp_path / "serve.log"
    with (
        process(["mock-engine", "--port", str(engine_port), "--speed", "0"], engine_log),
        process(["serve", "--engine", f"127.0.0.1:{engine_port}", "--port", str(port)], log) as gw,
    ):
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, gw, 90, log)
        models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
        assert models[0]["owned_by"] == "rankgate"
        reply = chat(base, models[0]["id"])
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3


def test_requiring_an_engine_refuses_the_demo_naming_the_variable(tmp_path: Path) -> None:
    for argv, env in (
        (["serve"], {"RANKGATE_REQUIRE_ENGINE": "true"}),
        (["serve", "--require-engine", "--disaggregated"], {}),
    ):
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "rankgate.app.cli", *argv],
            cwd=ROOT,
            env=_env(RANKGATE_PORT=str(free_port()), **env),
            capture_output=True,
            timeout=60,
        )
        assert done.returncode != 0
        assert b"RANKGATE_ENGINE" in done.stderr
        assert time.monotonic() - started < 30
