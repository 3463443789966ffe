"""How much CPU does the gateway spend per request and per streamed token?

Starts the mock engine (zero latency) and the gateway as separate processes on loopback,
drives them from this process (the client), and reads the gateway process's CPU time from
/proc before and after each phase:

- non-streaming chat requests: gateway CPU per request, latency p50/p99;
- streaming chat requests at two lengths: CPU per request, and the marginal CPU per streamed
  token (the slope between the two lengths, so per-request costs cancel out).

Real vLLM sends one message per token; the mock at zero latency coalesces the tokens produced
while the gateway was busy into fewer messages, which makes tokens look cheaper than they are.
The table therefore also counts the SSE chunks each request received, and the per-token figure
is the marginal CPU per chunk as well: pace the mock (``--mock-speed``, e.g. 8) until chunks
equal tokens to measure the one-token-per-message case.

    .venv/bin/python bench/gateway_overhead.py [--requests 2000] [--concurrency 16]
        [--mock-speed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
MODEL = "bench-model"
TICKS = os.sysconf("SC_CLK_TCK")
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a short poem about data-parallel routing."},
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@contextmanager
def process(args: list[str], name: str) -> Iterator[subprocess.Popen[bytes]]:
    log = open(f"/tmp/rankgate-bench-{name}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"gateway exited with {proc.returncode}; see /tmp/rankgate-bench-*.log"
            )
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("gateway not ready in time")


@dataclass
class Phase:
    name: str
    requests: int
    tokens: int
    chunks: int
    cpu: float
    wall: float
    latencies: list[float]

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def drive(
    url: str, pid: int, name: str, n: int, concurrency: int, stream: bool, max_tokens: int
) -> Phase:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    latencies: list[float] = []
    tokens = 0
    chunks = 0
    queue = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def worker() -> None:
            nonlocal tokens, chunks
            for _ in queue:
                start = time.perf_counter()
                if stream:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        last = ""
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                last = line
                                chunks += '"content":"' in line and '"content":""' not in line
                        tokens += json.loads(last[6:])["usage"]["completion_tokens"]
                else:
                    r = await client.post("/v1/chat/completions", json=body)
                    r.raise_for_status()
                    tokens += r.json()["usage"]["completion_tokens"]
                latencies.append(time.perf_counter() - start)

        cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu1, wall1 = cpu_seconds(pid), time.perf_counter()
    return Phase(name, n, tokens, chunks, cpu1 - cpu0, wall1 - wall0, latencies)


async def run(args: argparse.Namespace, url: str, pid: int) -> None:
    n, c = args.requests, args.concurrency
    await drive(url, pid, "warmup", max(200, n // 10), c, False, 8)
    await drive(url, pid, "warmup", max(100, n // 20), c, True, 8)
    short, long = args.short_tokens, args.long_tokens
    plain = await drive(url, pid, "chat", n, c, False, short)
    s_short = await drive(url, pid, "stream-short", n, c, True, short)
    s_long = await drive(url, pid, "stream-long", n // 2, c, True, long)
    print(
        f"gateway CPU, {n} requests per phase, concurrency {c} "
        f"(mock engine speed {args.mock_speed:g}; 0 = zero latency)"
    )
    print(
        f"{'phase':<14}{'reqs':>6}{'tokens':>8}{'chunks':>8}{'req/s':>9}{'CPU/req ms':>12}"
        f"{'p50 ms':>9}{'p99 ms':>9}"
    )
    for phase in (plain, s_short, s_long):
        print(
            f"{phase.name:<14}{phase.requests:>6}{phase.tokens:>8}{phase.chunks:>8}"
            f"{phase.requests / phase.wall:>9.0f}{phase.cpu / phase.requests * 1000:>12.3f}"
            f"{phase.pct(0.5):>9.2f}{phase.pct(0.99):>9.2f}"
        )
    per_req_short = s_short.cpu / s_short.requests
    per_req_long = s_long.cpu / s_long.requests
    tokens_short = s_short.tokens / s_short.requests
    tokens_long = s_long.tokens / s_long.requests
    per_token = (per_req_long - per_req_short) / (tokens_long - tokens_short)
    chunks_short = s_short.chunks / s_short.requests
    chunks_long = s_long.chunks / s_long.requests
    print(f"non-streaming CPU per request: {plain.cpu / plain.requests * 1e3:.3f} ms")
    print(
        f"streaming CPU per token (marginal, {tokens_short:.0f} vs {tokens_long:.0f} tokens): "
        f"{per_token * 1e6:.1f} us"
    )
    if chunks_long > chunks_short:
        per_chunk = (per_req_long - per_req_short) / (chunks_long - chunks_short)
        print(
            f"streaming CPU per chunk (marginal, {chunks_short:.1f} vs {chunks_long:.1f} "
            f"chunks): {per_chunk * 1e6:.1f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--mock-speed", type=float, default=0.0)
    args = parser.parse_args()
    engine_port, http_port = _port(), _port()
    mock = [
        sys.executable, "-m", "rankgate.mocker", "--port", str(engine_port), "--dp-size", "2",
        "--speed", str(args.mock_speed), "--model", MODEL, "--tokenizer", str(TOKENIZER),
        "--max-model-len", "4096", "--log-level", "warning",
    ]  # fmt: skip
    gateway = [
        sys.executable, "-m", "rankgate.app.cli", "serve", "--engine", f"127.0.0.1:{engine_port}",
        "--port", str(http_port), "--tokenizer", str(TOKENIZER), "--log-level", "warning",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    with process(mock, "mock"), process(gateway, "gateway") as gw:
        wait_ready(url, gw)
        asyncio.run(run(args, url, gw.pid))


if __name__ == "__main__":
    main()
