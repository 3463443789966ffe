"""How fast does the mock engine start, and how many streamed requests does it sustain?

The engine runs in a child process pinned to one core (zero-latency mode, DP=1); the load
generator is this process, on another core, with a pool of concurrent gRPC streams. Every
request streams 16 tokens (``ignore_eos``); a request counts when its final message arrives.

    .venv/bin/python bench/mock_engine_throughput.py [--seconds 10] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import time
from typing import Any

import grpc

from mocker.config import MockEngineConfig
from sidecar.proto.vllm import inference_pb2, inference_pb2_grpc
from tests.support.ports import free_port

TOKENS = 16


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _serve(config: MockEngineConfig, core: int, conn: Any, use_uvloop: bool) -> None:
    """Child process: the engine, answering CPU-time probes from the parent between runs."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    from mocker.server import MockServer

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


async def _load(target: str, seconds: float, concurrency: int) -> tuple[int, int, list[float]]:
    stop_at = time.perf_counter() + seconds
    done = 0
    tokens = 0
    latencies: list[float] = []
    prompt = inference_pb2.TokenIds(ids=list(range(300, 332)))
    stopping = inference_pb2.StoppingCriteria(max_new_tokens=TOKENS, ignore_eos=True)
    response = inference_pb2.ResponseOptions(output_text=True, output_token_ids=True)

    async with grpc.aio.insecure_channel(target) as channel:
        stub: Any = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--asyncio", action="store_true", help="run the engine on asyncio's loop, not uvloop"
    )
    args = parser.parse_args()

    port = free_port()
    config = MockEngineConfig(port=port, model="bench", speed=0.0, max_running_requests=1024)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    server_core, client_core = cores[0], cores[-1]
    conn, child_conn = mp.Pipe()
    process = mp.get_context("spawn").Process(
        target=_serve, args=(config, server_core, child_conn, not args.asyncio), daemon=True
    )
    spawned = time.perf_counter()
    process.start()
    try:
        startup = conn.recv()
        target = f"127.0.0.1:{port}"
        asyncio.run(_wait_ready(target))
        to_serving = time.perf_counter() - spawned
        if hasattr(os, "sched_setaffinity") and len(cores) > 1:
            os.sched_setaffinity(0, {client_core})
        asyncio.run(_load(target, args.warmup, args.concurrency))
        conn.send("cpu")
        cpu_before = conn.recv()
        done, tokens, latencies = asyncio.run(_load(target, args.seconds, args.concurrency))
        conn.send("cpu")
        server_cpu = conn.recv() - cpu_before
        conn.send("stop")
    finally:
        process.join(5)
        if process.is_alive():
            process.terminate()
    latencies.sort()
    p50 = latencies[len(latencies) // 2] * 1e3 if latencies else float("nan")
    p99 = latencies[int(len(latencies) * 0.99)] * 1e3 if latencies else float("nan")
    print(
        "mock engine throughput (zero-latency mode, DP=1, server on one core"
        + (", asyncio loop)" if args.asyncio else ", uvloop)")
    )
    print(f"{'metric':<34}{'value':>14}")
    print(f"{'server start (MockServer.start)':<34}{startup * 1e3:>12.1f} ms")
    print(f"{'process spawn to first RPC ready':<34}{to_serving * 1e3:>12.1f} ms")
    print(f"{'concurrency':<34}{args.concurrency:>14d}")
    print(f"{'streamed 16-token requests/s':<34}{done / args.seconds:>14.0f}")
    print(f"{'tokens/s':<34}{tokens / args.seconds:>14.0f}")
    print(f"{'server CPU busy (of one core)':<34}{server_cpu / args.seconds:>13.0%}")
    print(f"{'server CPU per request':<34}{server_cpu / max(done, 1) * 1e6:>11.0f} us")
    print(f"{'requests/s per server core':<34}{done / max(server_cpu, 1e-9):>14.0f}")
    print(f"{'tokens per request (check)':<34}{tokens / max(done, 1):>14.1f}")
    print(f"{'latency p50 / p99':<34}{p50:>8.1f} / {p99:.1f} ms")


if __name__ == "__main__":
    main()
