"""What does serving prefill and decode on separate engines cost the gateway per request?

Three zero-latency mock engines (DP=2 each) run in a child process on their own core: one
aggregated (role both), one prefill, one decode. The same workload streams through
``Sidecar.generate`` on the aggregated engine and through ``DisaggregatedEngine.generate`` on the
pair; the figures are this process's CPU time per request and the median time to the first
delta. The difference is the price of the second leg: a one-token prefill stream, its
``kv_transfer_params`` round trip and the decode's hand-off-safe read path.

    .venv/bin/python bench/disagg_overhead.py [--requests 2000] [--concurrency 32] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import socket
import statistics
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from rankgate.mocker.config import MockEngineConfig
from rankgate.mocker.transfer import Role
from rankgate.sidecar.config import DisaggConfig, SidecarConfig
from rankgate.sidecar.disagg import DisaggregatedEngine, routing_for
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.types import Delta, PreparedRequest, SamplingParams, StoppingParams

ROLES: tuple[Role, ...] = ("both", "prefill", "decode")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _serve(configs: list[MockEngineConfig], core: int, ready: Any, stop: Any) -> None:
    if hasattr(os, "sched_setaffinity") and core >= 0:
        os.sched_setaffinity(0, {core})
    from rankgate.mocker.server import MockServer

    async def main() -> None:
        servers = [MockServer(config) for config in configs]
        for server in servers:
            await server.start()
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        for server in servers:
            await server.stop()

    asyncio.run(main())


def _prepared(i: int, tokens: int) -> PreparedRequest:
    return PreparedRequest(
        request_id=f"bench-{i}",
        prompt_token_ids=tuple(300 + (i * 7 + k) % 500 for k in range(256)),
        sampling=SamplingParams(temperature=0.7, top_p=0.9),
        stopping=StoppingParams(max_tokens=tokens, ignore_eos=True),
    )


def _sidecar(target: str, split: bool) -> Sidecar:
    routing = RoutingConfig(policy="load")
    if split:
        routing = routing_for(routing)
    return Sidecar(SidecarConfig(endpoint=target), build_router(routing, CollectorRegistry()))


async def _run(
    generate: Callable[[PreparedRequest], AsyncIterator[Delta]],
    requests: int,
    concurrency: int,
    tokens: int,
) -> tuple[float, float]:
    """(CPU seconds, median seconds to the first delta) for ``requests`` requests."""
    queue = iter(range(requests))
    firsts: list[float] = []

    async def worker() -> None:
        for i in queue:
            started = time.perf_counter()
            first = True
            async for _ in generate(_prepared(i, tokens)):
                if first:
                    firsts.append(time.perf_counter() - started)
                    first = False

    cpu = _cpu()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _cpu() - cpu, statistics.median(firsts)


async def _measure(targets: dict[Role, str], requests: int, concurrency: int, tokens: int) -> Any:
    aggregated = _sidecar(targets["both"], False)
    split = DisaggregatedEngine(
        _sidecar(targets["prefill"], True),
        _sidecar(targets["decode"], True),
        DisaggConfig(prefill_mode="remote"),
    )
    await aggregated.start()
    await split.start()
    try:
        await _run(aggregated.generate, 200, concurrency, tokens)  # warm up both paths
        await _run(split.generate, 200, concurrency, tokens)
        one = await _run(aggregated.generate, requests, concurrency, tokens)
        two = await _run(split.generate, requests, concurrency, tokens)
    finally:
        await aggregated.close()
        await split.close()
    return one, two


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    ports = {role: _free_port() for role in ROLES}
    configs = [
        MockEngineConfig(
            host="127.0.0.1",
            port=ports[role],
            dp_size=2,
            model="mock-llm",
            speed=0.0,
            block_size=16,
            role=role,
        )
        for role in ROLES
    ]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    engine_core = cores[-1] if len(cores) > 1 else -1
    if len(cores) > 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cores[0]})
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_serve, args=(configs, engine_core, ready, stop), daemon=True)
    child.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("mock engines did not start")
        targets = {role: f"127.0.0.1:{port}" for role, port in ports.items()}
        # One loop for everything: grpc.aio binds its poller to the first loop it sees.
        (cpu_one, ttft_one), (cpu_two, ttft_two) = asyncio.run(
            _measure(targets, args.requests, args.concurrency, args.tokens)
        )
    finally:
        stop.set()
        child.join(10)
    n = args.requests
    print(
        f"{n} requests x {args.tokens} tokens, {args.concurrency} concurrent, 256-token prompts; "
        "gateway CPU time (engines on their own core)"
    )
    print(f"  {'path':<28} {'CPU us/request':>15} {'median first delta ms':>22}")
    print(f"  {'aggregated (one engine)':<28} {cpu_one / n * 1e6:15.1f} {ttft_one * 1e3:22.2f}")
    print(f"  {'disaggregated (two engines)':<28} {cpu_two / n * 1e6:15.1f} {ttft_two * 1e3:22.2f}")
    print(f"  {'added by disaggregation':<28} {(cpu_two - cpu_one) / n * 1e6:15.1f}")


if __name__ == "__main__":
    main()
