"""How fast does the mock engine start, and how many streamed requests does it sustain?

The engine runs in a child process pinned to one core (zero-latency mode, DP=1); the load
generator is this process, on another core, with a pool of concurrent gRPC streams. Every
request streams 16 tokens (``ignore_eos``); a request counts when its final message arrives.
Each of the engine's gRPC servers (``--grpc-server``: the in-loop HTTP/2 one and grpc.aio's)
is measured in turn, in a fresh engine process.

The load generator is the gateway's own in-loop HTTP/2 client by default: grpc.aio's client
spends about as much CPU per message as grpc.aio's server, so with it on the other core the
client, not the engine, sets the pace (``--client grpcio`` shows that).

    PYTHONPATH=. .venv/bin/python bench/mock_engine_throughput.py [--seconds 10]
        [--concurrency 64] [--server inloop|grpcio|both] [--client http2|grpcio]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
import uvloop

from rankgate.mocker.config import GRPC_SERVERS, GrpcServer, MockEngineConfig
from rankgate.sidecar.endpoint import Endpoint
from rankgate.sidecar.inference_client import InferenceClient
from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc
from tests.support.ports import free_port

TOKENS = 16


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _serve(config: MockEngineConfig, core: int, conn: Any, use_uvloop: bool) -> None:
    """Child process: the engine, answering CPU-time probes from the parent between runs."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    from rankgate.mocker.server import MockServer

    async def main() -> None:
        started = time.perf_counter()
        server = MockServer(config)
        await server.start()
        conn.send(time.perf_counter() - started)
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "stop":
                break
            conn.send(_cpu_seconds())
        await server.stop()

    if use_uvloop:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


async def _wait_ready(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        await channel.channel_ready()


async def _load(
    port: int, seconds: float, concurrency: int, client: str
) -> tuple[int, int, list[float]]:
    stop_at = time.perf_counter() + seconds
    done = 0
    tokens = 0
    latencies: list[float] = []
    prompt = inference_pb2.TokenIds(ids=list(range(300, 332)))
    stopping = inference_pb2.StoppingCriteria(max_new_tokens=TOKENS, ignore_eos=True)
    response = inference_pb2.ResponseOptions(output_text=True, output_token_ids=True)
    target = f"127.0.0.1:{port}"

    async with contextlib.AsyncExitStack() as stack:
        stub: Any
        if client == "http2":
            stub = InferenceClient(Endpoint("127.0.0.1", port, False), 64 << 20)
            stack.push_async_callback(stub.close)
        else:
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(target))
            stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]

        async def worker(index: int) -> None:
            nonlocal done, tokens
            n = 0
            while time.perf_counter() < stop_at:
                n += 1
                request = inference_pb2.GenerateRequest(
                    request_id=f"bench-{index}-{n}",
                    token_ids=prompt,
                    temperature=0.0,
                    stopping=stopping,
                    response=response,
                )
                started = time.perf_counter()
                async for message in stub.GenerateStream(request):
                    tokens += len(message.outputs.token_ids)
                latencies.append(time.perf_counter() - started)
                done += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done, tokens, latencies


@dataclass(frozen=True, slots=True)
class Result:
    startup: float
    to_serving: float
    done: int
    tokens: int
    server_cpu: float
    client_cpu: float
    latencies: list[float]


def _measure(
    server: GrpcServer, args: argparse.Namespace, client_core: int, server_core: int
) -> Result:
    port = free_port()
    config = MockEngineConfig(
        port=port, model="bench", speed=0.0, max_running_requests=1024, grpc_server=server
    )
    conn, child_conn = mp.Pipe()
    process = mp.get_context("spawn").Process(
        target=_serve, args=(config, server_core, child_conn, not args.asyncio), daemon=True
    )
    spawned = time.perf_counter()
    process.start()
    try:
        startup = conn.recv()
        uvloop.run(_wait_ready(f"127.0.0.1:{port}"))
        to_serving = time.perf_counter() - spawned
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {client_core})
        uvloop.run(_load(port, args.warmup, args.concurrency, args.client))
        conn.send("cpu")
        cpu_before = conn.recv()
        client_before = _cpu_seconds()
        done, tokens, latencies = uvloop.run(
            _load(port, args.seconds, args.concurrency, args.client)
        )
        client_cpu = _cpu_seconds() - client_before
        conn.send("cpu")
        server_cpu = conn.recv() - cpu_before
        conn.send("stop")
    finally:
        process.join(5)
        if process.is_alive():
            process.terminate()
    latencies.sort()
    return Result(startup, to_serving, done, tokens, server_cpu, client_cpu, latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--server", choices=[*GRPC_SERVERS, "both"], default="both")
    parser.add_argument(
        "--client",
        choices=["http2", "grpcio"],
        default="http2",
        help="load generator: the gateway's in-loop HTTP/2 client or grpc.aio's",
    )
    parser.add_argument(
        "--asyncio", action="store_true", help="run the engine on asyncio's loop, not uvloop"
    )
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    server_core, client_core = cores[0], cores[-1]
    servers: tuple[GrpcServer, ...] = (
        GRPC_SERVERS if args.server == "both" else (cast(GrpcServer, args.server),)
    )
    results = {name: _measure(name, args, client_core, server_core) for name in servers}
    names = {id(result): name for name, result in results.items()}

    def row(label: str, cell: Callable[[Result], str]) -> None:
        print(f"{label:<34}" + "".join(f"{cell(r):>16}" for r in results.values()))

    def per_second(r: Result) -> float:
        return float(r.done / args.seconds)

    def percentile(r: Result, q: float) -> float:
        lat = r.latencies
        return float(lat[min(int(len(lat) * q), len(lat) - 1)] * 1e3) if lat else float("nan")

    print(
        "mock engine throughput (zero-latency mode, DP=1, server on one core, "
        + ("asyncio loop" if args.asyncio else "uvloop")
        + f", {args.client} client on another, concurrency {args.concurrency})"
    )
    row("gRPC server", lambda r: names[id(r)])
    row("server start (MockServer.start)", lambda r: f"{r.startup * 1e3:.1f} ms")
    row("process spawn to first RPC ready", lambda r: f"{r.to_serving * 1e3:.1f} ms")
    row("streamed 16-token requests/s", lambda r: f"{per_second(r):.0f}")
    row("tokens/s", lambda r: f"{r.tokens / args.seconds:.0f}")
    row("server CPU busy (of one core)", lambda r: f"{r.server_cpu / args.seconds:.0%}")
    row("server CPU per request", lambda r: f"{r.server_cpu / max(r.done, 1) * 1e6:.0f} us")
    row("client CPU busy (of one core)", lambda r: f"{r.client_cpu / args.seconds:.0%}")
    row("requests/s per server core", lambda r: f"{r.done / max(r.server_cpu, 1e-9):.0f}")
    row("tokens per request (check)", lambda r: f"{r.tokens / max(r.done, 1):.1f}")
    row(
        "latency p50 / p99",
        lambda r: f"{percentile(r, 0.5):.1f} / {percentile(r, 0.99):.1f} ms",
    )


if __name__ == "__main__":
    main()
