"""Overload: thousands of concurrent slow clients against one gateway; does memory stay bounded?

Starts the mock engine and the gateway as separate processes (so the gateway's RSS is its
own), opens ``--clients`` connections that each send a streamed chat request and then read one
chunk every ``--read-interval`` seconds, holds them for ``--hold`` seconds, and samples the
gateway's RSS throughout. "held" counts connections open at once; status 0 means the client
was still waiting for its first token (queued in the engine) when its hold ended. Two
admission settings are run: one that admits every client (all held as live streams), and the
default derived from the engine's capacity (the rest queue or get 429 + Retry-After). Prints
one table row per run.

    .venv/bin/python bench/overload_rss.py --clients 5000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
PY = sys.executable


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


@dataclass
class Outcome:
    statuses: Counter[int]
    held_peak: int
    chunks: int


async def client(
    port: int, body: bytes, read_interval: float, hold_until: float, out: Outcome, live: list[int]
) -> None:
    """One slow client: it stays connected (waiting, or reading one chunk per interval) until
    ``hold_until``, or until the gateway answers something other than 200."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        out.statuses[-1] += 1
        return
    live[0] += 1
    out.held_peak = max(out.held_peak, live[0])
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        remaining = hold_until - time.monotonic()
        status_line = await asyncio.wait_for(reader.readline(), max(remaining, 0.1))
        status = int(status_line.split()[1]) if status_line else -2
        out.statuses[status] += 1
        if status != 200:
            return
        while time.monotonic() < hold_until:
            chunk = await reader.read(256)
            if not chunk:
                break
            out.chunks += 1
            await asyncio.sleep(read_interval)
    except TimeoutError:
        out.statuses[0] += 1
    except (OSError, ValueError, IndexError):
        out.statuses[-3] += 1
    finally:
        live[0] -= 1
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def sample(pid: int, stop: asyncio.Event, peaks: list[int]) -> None:
    while not stop.is_set():
        peaks.append(rss_kib(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def run_clients(
    port: int, pid: int, clients: int, hold: float, read_interval: float
) -> tuple[Outcome, int]:
    body = orjson.dumps(
        {
            "model": "bench-llm",
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 4000,
            "stream": True,
        }
    )
    out = Outcome(Counter(), 0, 0)
    live = [0]
    stop = asyncio.Event()
    peaks: list[int] = []
    sampler = asyncio.create_task(sample(pid, stop, peaks))
    hold_until = time.monotonic() + hold
    tasks = []
    for i in range(clients):
        tasks.append(asyncio.create_task(client(port, body, read_interval, hold_until, out, live)))
        if i % 200 == 199:
            await asyncio.sleep(0.05)
    await asyncio.gather(*tasks)
    stop.set()
    await sampler
    return out, max(peaks, default=0)


def wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"gateway at {url} not ready")


def one_run(args: argparse.Namespace, label: str, per_rank: int) -> None:
    engine_port, gw_port = free_port(), free_port()
    engine = subprocess.Popen(
        [PY, "-m", "rankgate.app.cli", "mock-engine", "--port", str(engine_port), "--dp-size", "2",
         "--model", "bench-llm", "--tokenizer", str(TOKENIZER), "--speed", str(args.speed),
         "--max-running-requests", str(args.max_running), "--log-level", "warning"],
        cwd=ROOT,
    )  # fmt: skip
    gateway = subprocess.Popen(
        [PY, "-m", "rankgate.app.cli", "serve", "--engine", f"127.0.0.1:{engine_port}",
         "--tokenizer", str(TOKENIZER), "--port", str(gw_port), "--log-level", "warning",
         "--admission-per-rank", str(per_rank), "--admission-queue", str(args.queue),
         "--admission-timeout", str(args.hold), "--stream-stall-timeout", "0"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{gw_port}"
        wait_ready(url)
        httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "bench-llm",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            timeout=30,
        )
        baseline = rss_kib(gateway.pid)
        began = time.monotonic()
        out, peak = asyncio.run(
            run_clients(gw_port, gateway.pid, args.clients, args.hold, args.read_interval)
        )
        elapsed = time.monotonic() - began
        hwm = rss_kib(gateway.pid, "VmHWM")
        after = rss_kib(gateway.pid)
        alive = gateway.poll() is None
        ready = httpx.get(f"{url}/ready", timeout=5).status_code
        statuses = ", ".join(f"{k}:{v}" for k, v in sorted(out.statuses.items()))
        per_client = (peak - baseline) / max(out.held_peak, 1)
        print(
            f"| {label:<26} | {args.clients:>7} | {out.held_peak:>11} | {statuses:<22} "
            f"| {baseline / 1024:>8.1f} | {peak / 1024:>8.1f} | {hwm / 1024:>8.1f} "
            f"| {after / 1024:>8.1f} | {per_client:>7.1f} | {elapsed:>5.1f} "
            f"| {'yes' if alive and ready == 200 else 'NO'} |",
            flush=True,
        )
    finally:
        for proc in (gateway, engine):
            proc.terminate()
        for proc in (gateway, engine):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=5000)
    parser.add_argument("--hold", type=float, default=20.0, help="seconds each client stays")
    parser.add_argument("--read-interval", type=float, default=1.0)
    parser.add_argument("--speed", type=float, default=0.05, help="mock engine speed")
    parser.add_argument("--max-running", type=int, default=64, help="mock per-rank batch")
    parser.add_argument("--queue", type=int, default=1024, help="gateway admission queue")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, args.clients * 2 + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    print(
        "| run                        | clients | held (peak) | HTTP statuses          "
        "| base MiB | peak MiB |  HWM MiB | end MiB | KiB/held |    s | serving |"
    )
    print("|" + "---|" * 11)
    one_run(args, "admit all (per-rank 1e5)", 100_000)
    one_run(args, "capacity-derived default", 0)


if __name__ == "__main__":
    main()
