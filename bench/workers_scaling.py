"""Does ``--workers 2`` serve more than ``--workers 1``? Throughput, latency and CPU per request.

Starts the mock engine (zero latency, DP=2) as its own process, then for each worker count a
gateway (``rankgate serve --workers N``) on loopback, and drives it from client processes that
speak raw HTTP/1.1 keep-alive (pre-encoded requests, so the client costs little CPU). Prints,
per worker count: requests/s, latency p50/p99, and the gateway's CPU time per request (the
supervisor and all workers, read from /proc), and their CPU per second idle, read before the
run. On a machine with fewer free cores than
workers + engine + clients the gain is capped by the cores, which the last column shows.

With ``--rate R`` the clients send a fixed R requests/s instead (open loop: each connection
keeps its own schedule and skips, rather than bunches, what it fell behind on). Below
saturation every worker count then serves the same load, so CPU per request shows what the
extra processes themselves cost (the shared load board, multi-process metrics, a second
sidecar); the last line gives each count's CPU per request over one worker's.

    .venv/bin/python bench/workers_scaling.py [--seconds 10] [--connections 32] [--clients 2]
        [--workers 1 2] [--max-tokens 8] [--rate 300]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "mocker" / "assets" / "tiny-tokenizer"
MODEL = "bench-model"
TICKS = os.sysconf("SC_CLK_TCK")
# Seconds with no requests, to read what the gateway's processes spend idle.
IDLE_S = 4.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    found = [pid]
    for parent in found:
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except FileNotFoundError:
            continue
        found += [int(c) for c in children]
    return found


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


@contextmanager
def _process(args: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    streak = 0
    while streak < 20:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise SystemExit(f"gateway exited during startup:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit("gateway did not become ready")
        try:
            ok = httpx.get(f"{url}/ready", timeout=5).status_code == 200
            streak = streak + 1 if ok else 0
        except httpx.TransportError:
            streak = 0
        time.sleep(0.05)


def _request(port: int, max_tokens: int) -> bytes:
    body = orjson.dumps(
        {"model": MODEL, "prompt": "Route this request well, please.", "max_tokens": max_tokens}
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _connection(
    port: int,
    payload: bytes,
    stop_at: float,
    latencies: list[float],
    errors: list[int],
    interval: float,
    offset: float,
) -> None:
    """Requests back to back, or with ``interval`` > 0 one every ``interval`` seconds from
    ``offset`` on (a late one goes at once; the schedule then restarts from it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    due = time.perf_counter() + offset
    try:
        while time.perf_counter() < stop_at:
            if interval > 0:
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                if due >= stop_at:
                    break
                due = max(due + interval, time.perf_counter())
            started = time.perf_counter()
            writer.write(payload)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(1)
            latencies.append(time.perf_counter() - started)
    finally:
        writer.close()


def _client(
    port: int, connections: int, seconds: float, max_tokens: int, rate: float, out: object
) -> None:
    """One client process; ``rate`` > 0 is its share of a fixed request rate."""
    import uvloop

    latencies: list[float] = []
    errors: list[int] = []
    payload = _request(port, max_tokens)
    interval = connections / rate if rate > 0 else 0.0

    async def run() -> None:
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(
            *(
                _connection(
                    port, payload, stop_at, latencies, errors, interval, interval * i / connections
                )
                for i in range(connections)
            )
        )

    uvloop.run(run())
    out.put((latencies, len(errors)))  # type: ignore[attr-defined]


@dataclass
class Result:
    workers: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    cpu_per_request_us: float
    gateway_cores: float
    engine_cores: float
    idle_ms_per_s: float


def _drive(
    port: int, pids: list[int], engine: int, args: argparse.Namespace, seconds: float
) -> tuple[list[float], int, float, float, float]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    per_client = max(1, args.connections // args.clients)
    rate = args.rate / args.clients
    clients = [
        ctx.Process(target=_client, args=(port, per_client, seconds, args.max_tokens, rate, out))
        for _ in range(args.clients)
    ]
    cpu_before = _cpu(pids)
    engine_before = _cpu([engine])
    wall = time.perf_counter()
    for client in clients:
        client.start()
    latencies: list[float] = []
    errors = 0
    for _ in clients:
        got, bad = out.get(timeout=seconds + 120)
        latencies += got
        errors += bad
    wall = time.perf_counter() - wall
    cpu = _cpu(pids) - cpu_before
    engine_cpu = _cpu([engine]) - engine_before
    for client in clients:
        client.join(30)
    return latencies, errors, wall, cpu, engine_cpu


def measure(workers: int, engine: str, engine_pid: int, args: argparse.Namespace) -> Result:
    port = _port()
    command = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--workers",
        str(workers),
        "--engine",
        engine,
        "--tokenizer",
        str(TOKENIZER),
        "--port",
        str(port),
        "--policy",
        args.policy,
        "--log-level",
        "warning",
    ]
    with _process(command) as gateway:
        _wait_ready(f"http://127.0.0.1:{port}", gateway)
        pids = _tree(gateway.pid)
        _drive(port, pids, engine_pid, args, 2.0)  # warm-up: connections and lazy paths
        idle_before, idle_started = _cpu(pids), time.perf_counter()
        time.sleep(IDLE_S)
        idle = (_cpu(pids) - idle_before) / (time.perf_counter() - idle_started)
        latencies, errors, wall, cpu, engine_cpu = _drive(
            port, pids, engine_pid, args, args.seconds
        )
    latencies.sort()
    count = len(latencies)
    return Result(
        workers=workers,
        requests=count,
        errors=errors,
        seconds=wall,
        p50_ms=latencies[count // 2] * 1000 if count else 0.0,
        p99_ms=latencies[min(count - 1, int(count * 0.99))] * 1000 if count else 0.0,
        cpu_per_request_us=cpu / count * 1e6 if count else 0.0,
        gateway_cores=cpu / wall,
        engine_cores=engine_cpu / wall,
        idle_ms_per_s=idle * 1000,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--policy", default="kv")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="fixed requests/s over all clients; 0 = flat out"
    )
    args = parser.parse_args()

    engine_port = _port()
    engine = [
        sys.executable,
        "-m",
        "app.cli",
        "mock-engine",
        "--port",
        str(engine_port),
        "--dp-size",
        "2",
        "--speed",
        "0",
        "--model",
        MODEL,
        "--model-id",
        str(TOKENIZER),
        "--tokenizer",
        str(TOKENIZER),
        "--kv-events-port",
        str(_port()),
        "--kv-replay-port",
        str(_port()),
        "--log-level",
        "warning",
    ]
    with _process(engine) as mock:
        time.sleep(1.0)
        target = f"127.0.0.1:{engine_port}"
        results = [measure(count, target, mock.pid, args) for count in args.workers]
    cores = os.cpu_count()
    load = f"a fixed {args.rate:.0f} req/s" if args.rate > 0 else "as fast as they can"
    print(
        f"rankgate --workers scaling: mock engine (DP=2, zero latency), {args.connections} "
        f"keep-alive connections from {args.clients} client processes sending {load}, "
        f"{args.max_tokens}-token non-streamed completions, {args.seconds:.0f} s per run, "
        f"{cores} CPU cores"
    )
    print(
        f"{'workers':>7} {'req/s':>8} {'speedup':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'CPU/req us':>10} {'gateway cores':>13} {'engine cores':>12} {'errors':>6} "
        f"{'idle ms/s':>9}"
    )
    base = results[0].requests / results[0].seconds if results and results[0].requests else 0
    for r in results:
        rate = r.requests / r.seconds
        print(
            f"{r.workers:>7} {rate:>8.0f} {rate / base if base else 0:>6.2f}x {r.p50_ms:>7.2f} "
            f"{r.p99_ms:>7.2f} {r.cpu_per_request_us:>10.0f} {r.gateway_cores:>13.2f} "
            f"{r.engine_cores:>12.2f} {r.errors:>6} {r.idle_ms_per_s:>9.1f}"
        )
    if results and results[0].cpu_per_request_us:
        one = results[0]
        ratios = ", ".join(
            f"{r.workers}: {r.cpu_per_request_us / one.cpu_per_request_us:.2f}x"
            for r in results[1:]
        )
        print(f"CPU per request over {one.workers} worker(s)'s: {ratios}")


if __name__ == "__main__":
    main()
