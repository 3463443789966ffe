"""CPU the KV-event intake spends per batch when batches arrive one at a time.

At a moderate request rate vLLM publishes each step's few events as a batch of their own, so
what the intake costs per batch, not its peak throughput (``bench/routing_index.py``), sets
its share of a request. A publisher in another process (as vLLM is) sends single-event
``BlockStored`` batches to two ranks at ``--rate`` batches per second; this process runs the
router's intake alone and reports its own CPU per batch, its idle CPU subtracted, and how
that splits between ZMQ's I/O thread and the Python threads.

With ``--coalesce`` the intake lets batches gather that long after each wake-up (the
router's ``--kv-coalesce``); each value given is measured in turn.

    PYTHONPATH=. .venv/bin/python bench/kv_intake_rate.py [--rate 200] [--seconds 5]
        [--coalesce 0 0.005]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.events import IntakeSettings
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.types import KvEventSource
from tests.routing.conftest import engine_info
from tests.support.ports import free_port

RANKS = 2
TICKS = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent

_PUBLISHER = """
import sys, time, msgspec, zmq
from tests.routing.publisher import stored
rate, count, endpoints = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
context = zmq.Context()
sockets = []
for endpoint in endpoints:
    socket = context.socket(zmq.PUB)
    socket.bind(endpoint)
    sockets.append(socket)
encode = msgspec.msgpack.Encoder().encode
time.sleep(2.0)
sequence = [0] * len(sockets)
start = time.perf_counter()
for i in range(count):
    rank = i % len(sockets)
    event = stored([4 * i + 1, 4 * i + 2], list(range(32)), block_size=16)
    payload = encode([time.time(), [event], None])
    sockets[rank].send_multipart([b"", sequence[rank].to_bytes(8, "big"), payload])
    sequence[rank] += 1
    time.sleep(max(0.0, start + (i + 1) / rate - time.perf_counter()))
time.sleep(0.5)
"""


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads: ZMQ's I/O thread, and the Python threads
    (the intake thread and the event loop; Python 3.11 does not name OS threads)."""
    groups = {"zmq_io": 0.0, "python": 0.0}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except FileNotFoundError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / TICKS
        groups["zmq_io" if name.startswith("ZMQbg/IO") else "python"] += seconds
    return groups


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(rate: float, seconds: float, coalesce: float) -> None:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(RANKS)]
    registry = CollectorRegistry()
    config = RoutingConfig(pending_ttl=0, intake=IntakeSettings(coalesce=coalesce))
    router = build_router(config, registry)
    sources = [KvEventSource(rank, endpoints[rank], None, "") for rank in range(RANKS)]
    router.configure(
        engine_info(
            range(RANKS), block_size=16, kv_blocks=100_000, max_running=256, sources=sources
        )
    )
    await router.start()
    count = int(rate * seconds)
    publisher = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _PUBLISHER,
        str(rate),
        str(count),
        *endpoints,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    await asyncio.sleep(2.5)
    before, started, threads = _cpu(), time.perf_counter(), _thread_cpu()
    await publisher.wait()
    busy, wall = _cpu() - before, time.perf_counter() - started
    split = {name: spent - threads[name] for name, spent in _thread_cpu().items()}
    before = _cpu()
    await asyncio.sleep(3.0)
    idle = (_cpu() - before) / 3.0
    applied = sum(
        registry.get_sample_value(
            "rankgate_kv_event_batches_total", {"rank": str(rank), "origin": "live"}
        )
        or 0.0
        for rank in range(RANKS)
    )
    turns = registry.get_sample_value("rankgate_kv_event_turns_total") or 0.0
    await router.close()
    print(
        f"KV-event intake, {RANKS} ranks, single-event batches at {rate:g}/s for {seconds:g} s, "
        f"coalesce {coalesce * 1000:g} ms: {applied:.0f} of {count} applied in {turns:.0f} "
        f"wake-ups, idle {idle * 1000:.1f} ms CPU/s, "
        f"{(busy - idle * wall) / count * 1e6:.0f} us CPU per batch ("
        + ", ".join(f"{name} {spent / count * 1e6:.0f}" for name, spent in split.items())
        + " us, idle included)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="batches per second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--coalesce", type=float, nargs="+", default=[0.0, 0.005])
    args = parser.parse_args()
    for coalesce in args.coalesce:
        asyncio.run(_measure(args.rate, args.seconds, coalesce))


if __name__ == "__main__":
    main()
