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
sidecar). The last lines give each run's CPU per request over that of the one-worker run
before it, and their median: interleave the counts (``--workers 1 2 1 2 ...``), since the
machine drifts between runs by as much as the effect.

Two controls, each changing one thing:

* ``--policy round_robin``: no KV routing, so no KV-event intake and no shared KV table;
* ``--separate``: a count N > 1 runs N independent one-worker gateways on N ports instead, the
  clients split between them. That is two processes sharing the load with none of the
  workers' machinery (no supervisor, shared board, shared KV table or multi-process metrics),
  so the gap between it and ``--workers N`` is what the machinery costs.

``--pin 0:1`` runs the gateway's processes on CPU 0 and the engine and clients on CPU 1, so
every run places its processes alike.

    .venv/bin/python bench/workers_scaling.py [--seconds 10] [--connections 32] [--clients 2]
        [--workers 1 2] [--max-tokens 8] [--rate 300] [--separate] [--pin 0:1]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
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


def _stat(path: Path) -> tuple[str, float, float] | None:
    """A process's or thread's name, and its user and system CPU seconds; None once gone."""
    try:
        stat = path.read_text()
    except FileNotFoundError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    return name, int(fields[11]) / TICKS, int(fields[12]) / TICKS


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        found = _stat(Path(f"/proc/{pid}/stat"))
        if found is not None:
            total += found[1] + found[2]
    return total


# A thread of the gateway: its process's place in the gateway's process list, and its name
# ("main" for a process's first thread, else the name the OS has for it).
ThreadKey = tuple[int, str]


def _threads(pids: list[int]) -> dict[tuple[int, int], tuple[ThreadKey, float, float]]:
    """Every thread of ``pids``: its key, and its user and system CPU seconds so far."""
    found = {}
    for place, pid in enumerate(pids):
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except FileNotFoundError:
            continue
        for task in tasks:
            thread = _stat(task / "stat")
            if thread is None:
                continue
            name, user, system = thread
            tid = int(task.name)
            found[pid, tid] = ((place, "main" if tid == pid else name), user, system)
    return found


def _tally(
    into: dict[ThreadKey, list[float]],
    before: dict[tuple[int, int], tuple[ThreadKey, float, float]],
    after: dict[tuple[int, int], tuple[ThreadKey, float, float]],
) -> None:
    for thread, (key, user, system) in after.items():
        _, user_before, system_before = before.get(thread, (key, 0.0, 0.0))
        spent = into.setdefault(key, [0.0, 0.0])
        spent[0] += user - user_before
        spent[1] += system - system_before


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
    port: int,
    connections: int,
    seconds: float,
    max_tokens: int,
    rate: float,
    cpus: set[int] | None,
    out: object,
) -> None:
    """One client process; ``rate`` > 0 is its share of a fixed request rate."""
    import uvloop

    if cpus:
        os.sched_setaffinity(0, cpus)

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


@dataclass
class Drive:
    """What one stretch of load cost: the gateway's CPU seconds, the engine's, and the wall."""

    latencies: list[float]
    errors: int
    wall: float
    cpu: float
    engine_cpu: float

    def __add__(self, other: Drive) -> Drive:
        return Drive(
            self.latencies + other.latencies,
            self.errors + other.errors,
            self.wall + other.wall,
            self.cpu + other.cpu,
            self.engine_cpu + other.engine_cpu,
        )

    @property
    def cpu_per_request_us(self) -> float:
        return self.cpu / len(self.latencies) * 1e6 if self.latencies else 0.0

    def result(self, workers: int, idle: float) -> Result:
        latencies = sorted(self.latencies)
        count = len(latencies)
        return Result(
            workers=workers,
            requests=count,
            errors=self.errors,
            seconds=self.wall,
            p50_ms=latencies[count // 2] * 1000 if count else 0.0,
            p99_ms=latencies[min(count - 1, int(count * 0.99))] * 1000 if count else 0.0,
            cpu_per_request_us=self.cpu_per_request_us,
            gateway_cores=self.cpu / self.wall,
            engine_cores=self.engine_cpu / self.wall,
            idle_ms_per_s=idle * 1000,
        )


@dataclass
class Gateway:
    """A running gateway (or, with ``--separate``, several): where to send, whose CPU to read."""

    workers: int
    ports: list[int]
    pids: list[int]
    # Each thread's user and system CPU seconds per second while idle, before any run.
    idle_threads: dict[ThreadKey, list[float]]


def _drive(gateway: Gateway, engine: int, args: argparse.Namespace, seconds: float) -> Drive:
    """Load the gateway for ``seconds`` (client ``i`` to ``ports[i % len(ports)]``)."""
    ports = gateway.ports
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    per_client = max(1, args.connections // args.clients)
    rate = args.rate / args.clients
    cpus = args.pin[1] if args.pin else None
    clients = [
        ctx.Process(
            target=_client,
            args=(ports[i % len(ports)], per_client, seconds, args.max_tokens, rate, cpus, out),
        )
        for i in range(args.clients)
    ]
    cpu_before = _cpu(gateway.pids)
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
    cpu = _cpu(gateway.pids) - cpu_before
    engine_cpu = _cpu([engine]) - engine_before
    for client in clients:
        client.join(30)
    return Drive(latencies, errors, wall, cpu, engine_cpu)


def _pinned(command: list[str], cpus: set[int] | None) -> list[str]:
    if not cpus:
        return command
    return ["taskset", "-c", ",".join(str(c) for c in sorted(cpus)), *command]


def _command(port: int, workers: int, engine: str, args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "rankgate.app.cli",
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
    return _pinned(command, args.pin[0] if args.pin else None)


def start(
    stack: ExitStack, workers: int, engine: str, engine_pid: int, args: argparse.Namespace
) -> tuple[Gateway, float]:
    """``rankgate serve --workers N``, or with ``--separate`` N one-worker gateways, warmed up;
    and their CPU seconds per second idle."""
    apart = args.separate and workers > 1
    layout = [(_port(), 1) for _ in range(workers)] if apart else [(_port(), workers)]
    if len(layout) > args.clients:
        raise SystemExit(f"--separate {workers} needs at least {workers} --clients")
    pids: list[int] = []
    for port, count in layout:
        process = stack.enter_context(_process(_command(port, count, engine, args)))
        _wait_ready(f"http://127.0.0.1:{port}", process)
        pids += _tree(process.pid)
    gateway = Gateway(workers, [port for port, _ in layout], pids, {})
    _drive(gateway, engine_pid, args, 2.0)  # warm-up: connections and lazy paths
    before, idle_before, idle_started = _threads(pids), _cpu(pids), time.perf_counter()
    time.sleep(args.idle)
    idle = time.perf_counter() - idle_started
    _tally(gateway.idle_threads, before, _threads(pids))
    for spent in gateway.idle_threads.values():
        spent[0] /= idle
        spent[1] /= idle
    return gateway, (_cpu(pids) - idle_before) / idle


def measure(workers: int, engine: str, engine_pid: int, args: argparse.Namespace) -> Result:
    """One run, on a gateway of its own."""
    with ExitStack() as stack:
        gateway, idle = start(stack, workers, engine, engine_pid, args)
        return _drive(gateway, engine_pid, args, args.seconds).result(workers, idle)


@dataclass
class Interleaved:
    results: list[Result]
    # Each round's CPU per request of each later count over the first count's.
    ratios: list[float]
    # Per count, each thread's user and system CPU seconds over all its turns.
    threads: list[dict[ThreadKey, list[float]]]
    # Per count, each thread's user and system CPU seconds per second idle.
    idle: list[dict[ThreadKey, list[float]]]


def measure_interleaved(
    counts: list[int], engine: str, engine_pid: int, args: argparse.Namespace
) -> Interleaved:
    """Every count's gateway up at once, loaded in turn for ``--seconds`` each, ``--rounds``
    times; per count, the sum of its turns. Drift that lasts longer than a round falls on every
    count alike."""
    totals: list[Drive | None] = [None] * len(counts)
    threads: list[dict[ThreadKey, list[float]]] = [{} for _ in counts]
    ratios: list[float] = []
    with ExitStack() as stack:
        started = [start(stack, count, engine, engine_pid, args) for count in counts]
        for _ in range(args.rounds):
            turns = []
            for i, (gateway, _) in enumerate(started):
                before = _threads(gateway.pids)
                turns.append(_drive(gateway, engine_pid, args, args.seconds))
                _tally(threads[i], before, _threads(gateway.pids))
            for i, turn in enumerate(turns):
                total = totals[i]
                totals[i] = turn if total is None else total + turn
            base = turns[0].cpu_per_request_us
            ratios += [t.cpu_per_request_us / base for t in turns[1:] if base]
    results = [
        total.result(count, idle)
        for total, count, (_, idle) in zip(totals, counts, started, strict=True)
        if total is not None
    ]
    idle = [gateway.idle_threads for gateway, _ in started]
    return Interleaved(results, ratios, threads, idle)


def _cpu_split(text: str) -> tuple[set[int], set[int]]:
    gateway, _, others = text.partition(":")
    try:
        sets = tuple({int(c) for c in part.split(",")} for part in (gateway, others))
    except ValueError:
        message = f"expected GATEWAY:OTHERS CPU lists, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    return sets[0], sets[1]


def pair_ratios(results: list[Result]) -> list[float]:
    """Each run's CPU per request over that of the latest one-worker run before it."""
    ratios = []
    one: Result | None = None
    for r in results:
        if r.workers == 1:
            one = r
        elif one is not None and one.cpu_per_request_us:
            ratios.append(r.cpu_per_request_us / one.cpu_per_request_us)
    return ratios


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
    parser.add_argument(
        "--separate",
        action="store_true",
        help="control: a count N > 1 runs N independent one-worker gateways",
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=IDLE_S,
        help="seconds each gateway is left idle after its warm-up, to read its idle CPU",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="start every count's gateway once and load them in turn, --seconds each, this "
        "many times (0: one gateway after another)",
    )
    parser.add_argument(
        "--pin",
        type=_cpu_split,
        default=None,
        metavar="GATEWAY:OTHERS",
        help="CPU lists for the gateway and for the engine and clients, e.g. 0:1",
    )
    args = parser.parse_args()

    engine_port = _port()
    engine = [
        sys.executable,
        "-m",
        "rankgate.app.cli",
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
    with _process(_pinned(engine, args.pin[1] if args.pin else None)) as mock:
        time.sleep(1.0)
        target = f"127.0.0.1:{engine_port}"
        if args.rounds > 0:
            counts = list(dict.fromkeys(args.workers))
            interleaved = measure_interleaved(counts, target, mock.pid, args)
            results, ratios = interleaved.results, interleaved.ratios
        else:
            results = [measure(count, target, mock.pid, args) for count in args.workers]
            ratios = pair_ratios(results)
    cores = os.cpu_count()
    load = f"a fixed {args.rate:.0f} req/s" if args.rate > 0 else "as fast as they can"
    layout = "N independent one-worker gateways" if args.separate else "--workers N"
    pinning = (
        f", gateway on CPUs {sorted(args.pin[0])}, engine and clients on {sorted(args.pin[1])}"
        if args.pin
        else ""
    )
    print(
        f"rankgate --workers scaling: mock engine (DP=2, zero latency), {args.connections} "
        f"keep-alive connections from {args.clients} client processes sending {load}, "
        f"{args.max_tokens}-token non-streamed completions, {args.seconds:.0f} s per run"
        f"{f' in {args.rounds} interleaved rounds' if args.rounds else ''}, "
        f"{cores} CPU cores, policy {args.policy}, {layout}{pinning}"
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
    if ratios:
        listed = ", ".join(f"{r:.2f}x" for r in ratios)
        against = (
            f"{results[0].workers} worker(s)'s in the same round"
            if args.rounds
            else ("the one-worker run before it")
        )
        print(f"CPU per request over {against}: {listed}")
        print(f"median: {statistics.median(ratios):.2f}x over {len(ratios)} pairs")
    if args.rounds and len(results) > 1 and results[0].cpu_per_request_us:
        pooled = ", ".join(
            f"{r.workers}: {r.cpu_per_request_us / results[0].cpu_per_request_us:.2f}x"
            for r in results[1:]
        )
        print(f"all rounds together, over {results[0].workers} worker(s)'s: {pooled}")
        print("user + system CPU per request, by thread (process: the gateway's Nth process):")
        for result, spent in zip(results, interleaved.threads, strict=True):
            per = 1e6 / result.requests if result.requests else 0.0
            for (place, name), (user, system) in sorted(spent.items()):
                if user + system > 0:
                    print(
                        f"  {result.workers} worker(s), process {place}, {name:<14} "
                        f"{user * per:6.0f} + {system * per:4.0f} us"
                    )
        print(f"idle, user + system CPU per second, by thread ({args.idle:.0f} s):")
        for result, spent in zip(results, interleaved.idle, strict=True):
            for (place, name), (user, system) in sorted(spent.items()):
                if user + system > 0:
                    print(
                        f"  {result.workers} worker(s), process {place}, {name:<14} "
                        f"{user * 1000:6.1f} + {system * 1000:4.1f} ms/s"
                    )


if __name__ == "__main__":
    main()
