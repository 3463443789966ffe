"""Routing under production-shaped traffic: skewed prefixes, open-loop arrivals, KV pressure.

Each configuration (DP size, load) runs every target on a fresh mock engine (its own process:
per-rank scheduling, chunked prefill, a bounded prefix cache with LRU eviction, preemption),
in interleaved rounds so that the machine's drift falls on all of them alike:

- ``rankgate kv`` (and any other ``--policy``), Rankgate's own routers;
- ``vllm-router kv_aware``, fed by the same KV events, and ``round_robin`` as the baseline.

The workload (``tests/support/sessions.py``), the same for every target of a configuration
(one seed):

- sessions arrive as a Poisson process; each opens with one of ``--prompts`` long system prompts,
  drawn with Zipf skew ``--zipf`` (1.3 over 64 prompts gives the most popular about a third of
  the sessions), then a user message of its own;
- a session runs a geometric number of turns (mean ``--turns``), as agents do: every turn waits
  for the previous answer and a pause, then resends the whole history plus a new message, so
  contexts grow;
- ``--long`` draws system prompts of 8k-32k tokens instead of 1k-3k;
- each rank's KV cache (``--kv-blocks``) is smaller than the working set, so evictions matter;
- ``--slow-rank 0.4`` runs rank 0 at that factor of ``--speed`` (calibrated as if it were not
  slow), ``--bursts`` sends sessions in on/off waves of the same mean rate, and a quarter of
  ``--kv-blocks`` (512) makes the caches a quarter of the working set.

The load is relative to the engine's capacity under round robin: ``--calibrate-seconds`` of
sessions through ``round_robin`` at a probe rate measure the share of the time its ranks are
stepping (the mock's modelled step time), and ``--load 0.7`` offers the rate at which round
robin would keep them stepping 70% of the time. The engine, not the gateway's CPU, must be
what saturates: on a small machine lower ``--speed`` (slower steps, fewer requests a second).
Printed per target: TTFT mean, p50 and p99 and mean end-to-end latency at the client, completed
requests per second, the engine's own prefix-cache hit rate, the busiest rank's share of the
prefill work (uncached prompt tokens) and of the requests, as a multiple of a fair share (1.00 =
even), and the busiest rank's share of time stepping. Beside them, the engine floor: the mean and
p99 of each request's least TTFT under any router (its rank idle, holding every block an
earlier request carried, prefilling only the rest), which no router can go below.

    scripts/in-netns .venv/bin/python bench/production_routing.py --dp 4 8 16 --load 0.7 0.9 \
        [--rounds 2] [--seconds 40] [--long] [--markdown] \
        [--variant 'spread=--route-hot-spill-requests 4' ...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import math
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import peers

from rankgate.mocker.config import MockEngineConfig
from rankgate.sidecar.routing.hashing import prompt_keys
from tests.support.ports import free_port, free_port_range
from tests.support.rank_sim import EngineModel
from tests.support.sessions import Bursts, Session, Shape, sessions, system_prompts

BLOCK = 16


# The engine runs in a process of its own, so that the load generator's work does not slow
# its scheduler; it answers "stats" with every rank's counters.


def _engine_process(config: MockEngineConfig, conn: Connection) -> None:
    from tests.support.mock_engine import running_mock_engine

    with running_mock_engine(config) as handle:
        conn.send("ready")
        while (command := conn.recv()) != "stop":
            assert command == "stats"
            conn.send(
                {
                    rank: (
                        s.prompt_tokens,
                        s.cached_tokens,
                        s.requests_received,
                        s.preemptions,
                        s.busy_seconds,
                    )
                    for rank, s in handle.all_stats().items()
                }
            )
    conn.send("stopped")


class EngineProcess:
    def __init__(self, config: MockEngineConfig) -> None:
        self.model = EngineModel(
            dp=config.dp_size,
            block_size=config.block_size,
            max_batched_tokens=config.max_batched_tokens,
            step_seconds=config.decode_step_seconds,
            sequence_seconds=config.decode_seconds_per_sequence,
            token_seconds=config.prefill_seconds_per_token,
            speed=config.speed,
            speeds=config.rank_speeds,
        )
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_engine_process, args=(config, child), daemon=True)
        self._proc.start()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            raise RuntimeError("the mock engine did not start")

    def stats(self) -> dict[int, tuple[int, int, int, int, float]]:
        self._conn.send("stats")
        stats: dict[int, tuple[int, int, int, int, float]] = self._conn.recv()
        return stats

    def stop(self) -> None:
        self._conn.send("stop")
        self._conn.poll(30)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


@contextmanager
def mock_engine(
    args: argparse.Namespace, dp: int, model_dir: Path, calibrating: bool = False
) -> Iterator[tuple[peers.Engine, EngineProcess]]:
    """The mock engine of one run; calibrating, with every rank at full speed, so that a slow
    rank's load is measured against the rate the same engine would take were it not slow."""
    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=dp,
        block_size=BLOCK,
        model="bench-llm",
        model_id=str(model_dir),
        tokenizer=str(model_dir),
        total_kv_blocks=args.kv_blocks * dp,
        max_running_requests=args.max_running,
        max_model_len=min(65536 if args.long else 16384, (args.kv_blocks - 1) * BLOCK),
        kv_events_port=free_port_range(dp),
        kv_replay_port=free_port_range(dp),
        speed=args.speed,
        rank_speeds=() if calibrating or args.slow_rank is None else (args.slow_rank,),
        eos_probability=0.0,
    )
    engine = EngineProcess(config)
    try:
        target = f"127.0.0.1:{config.port}"
        yield (
            peers.Engine(target, dp, BLOCK, config.model, model_dir, config.kv_events_port),
            engine,
        )
    finally:
        engine.stop()


@dataclasses.dataclass
class Outcome:
    target: str
    ttfts: list[float] = dataclasses.field(default_factory=list)
    latencies: list[float] = dataclasses.field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    prompt: int = 0
    cached: int = 0
    # Per pass: the busiest rank's prefill work and requests over a fair share.
    work_share: list[float] = dataclasses.field(default_factory=list)
    request_share: list[float] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    # Per pass: each rank's share of the time it was stepping.
    busy: list[list[float]] = dataclasses.field(default_factory=list)
    # Per request: the engine-side TTFT no router could beat (``Floor``).
    floors: list[float] = dataclasses.field(default_factory=list)

    def absorb(self, other: Outcome) -> None:
        self.ttfts += other.ttfts
        self.latencies += other.latencies
        self.errors += other.errors
        self.seconds += other.seconds
        self.prompt += other.prompt
        self.cached += other.cached
        self.work_share += other.work_share
        self.request_share += other.request_share
        self.preemptions += other.preemptions
        self.busy += other.busy
        self.floors += other.floors


class Floor:
    """Each request's least TTFT under any router: its rank idle and holding every block an
    earlier request carried, the rest prefilled alone at the mock's modelled step times
    (``EngineModel.floor``); the gateway's and the network's time come on top."""

    def __init__(self, model: EngineModel) -> None:
        self.model = model
        self._carried: set[int] = set()

    def __call__(self, prompt: Sequence[int]) -> float:
        keys = prompt_keys(prompt, self.model.block_size).hashes
        carried = self._carried
        seen = next((i for i, key in enumerate(keys) if key not in carried), len(keys))
        carried.update(keys)
        return self.model.floor(len(prompt), seen)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else math.nan


async def _turn(
    http: httpx.AsyncClient,
    model: str,
    prompt: Sequence[int],
    out: int,
    outcome: Outcome,
    floor: float,
) -> None:
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": out,
        "min_tokens": out,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    started = time.perf_counter()
    first = 0.0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                outcome.errors += 1
                return
            async for line in response.aiter_lines():
                if not first and line.startswith("data: {"):
                    first = time.perf_counter() - started
    except httpx.HTTPError:
        outcome.errors += 1
        return
    outcome.ttfts.append(first)
    outcome.floors.append(floor)
    outcome.latencies.append(time.perf_counter() - started)


async def _session(
    http: httpx.AsyncClient,
    model: str,
    systems: Sequence[tuple[int, ...]],
    session: Session,
    outcome: Outcome,
    origin: float,
    floor: Floor,
) -> None:
    await asyncio.sleep(max(0.0, origin + session.start - time.perf_counter()))
    history: list[int] = list(systems[session.system])
    for turn, message in enumerate(session.messages):
        if turn:
            history += session.answers[turn - 1]
            await asyncio.sleep(session.pauses[turn - 1])
        history += message
        await _turn(http, model, history, session.outputs[turn], outcome, floor(history))


def _client(gateway: peers.Gateway) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024, keepalive_expiry=2)
    return httpx.AsyncClient(
        base_url=gateway.url, headers=gateway.headers, timeout=300.0, limits=limits
    )


async def drive(
    gateway: peers.Gateway,
    engine: peers.Engine,
    process: EngineProcess,
    systems: Sequence[tuple[int, ...]],
    plan: Sequence[Session],
    name: str,
) -> Outcome:
    outcome = Outcome(name)
    floor = Floor(process.model)
    before = process.stats()
    async with _client(gateway) as http:
        origin = time.perf_counter()
        await asyncio.gather(
            *(_session(http, engine.model, systems, s, outcome, origin, floor) for s in plan)
        )
        outcome.seconds = time.perf_counter() - origin
    after = process.stats()
    work = []
    requests = []
    for rank in sorted(after):
        prompt = after[rank][0] - before[rank][0]
        cached = after[rank][1] - before[rank][1]
        outcome.prompt += prompt
        outcome.cached += cached
        work.append(prompt - cached)
        requests.append(after[rank][2] - before[rank][2])
        outcome.preemptions += after[rank][3] - before[rank][3]
    outcome.busy.append(
        [(after[rank][4] - before[rank][4]) / outcome.seconds for rank in sorted(after)]
    )
    dp = len(after)
    if sum(work):
        outcome.work_share.append(max(work) * dp / sum(work))
    if sum(requests):
        outcome.request_share.append(max(requests) * dp / sum(requests))
    return outcome


async def calibrate(
    gateway: peers.Gateway,
    engine: peers.Engine,
    process: EngineProcess,
    systems: Sequence[tuple[int, ...]],
    shape: Shape,
    seconds: float,
) -> float:
    """The session rate at which round robin would keep every rank stepping all the time,
    from the share of ``seconds`` its ranks step at a probe rate well below that."""
    probe = 0.1 * engine.dp_size
    while True:
        plan = sessions(shape, probe, seconds, shape.seed + 99)
        outcome = await drive(gateway, engine, process, systems, plan, "calibration")
        busy = statistics.fmean(outcome.busy[0])
        if busy < 0.6 or probe < 0.01:
            return probe / max(busy, 1e-3)
        probe /= 2


Starter = Callable[[ExitStack, peers.Engine], peers.Gateway]


def _rankgate(
    stack: ExitStack, engine: peers.Engine, policy: str, extra: Sequence[str] = ()
) -> peers.Gateway:
    return peers.start_rankgate(stack, engine, policy, extra)


def starters(policies: Sequence[str], variants: Sequence[str] = ()) -> dict[str, Starter]:
    found: dict[str, Starter] = {}
    for policy in policies:
        found[f"rankgate {policy}"] = functools.partial(_rankgate, policy=policy)
    for variant in variants:
        name, _, flags = variant.partition("=")
        found[f"rankgate {name}"] = functools.partial(
            _rankgate, policy="kv", extra=tuple(flags.split())
        )
    found["vllm-router kv_aware"] = lambda s, e: peers.start_vllm_router(s, e, "kv_aware")
    found["round_robin"] = lambda s, e: peers.start_rankgate(s, e, "round_robin")
    return found


HEAD = [
    "DP", "load", "target", "requests", "errors", "mean TTFT ms", "p50 TTFT ms", "p99 TTFT ms",
    "mean e2e ms", "engine floor mean / p99 ms", "req/s", "hit rate", "busiest rank work",
    "busiest rank requests", "busiest rank busy", "preemptions",
]  # fmt: skip


def row(dp: int, load: float, o: Outcome) -> list[str]:
    def ms(value: float) -> str:
        return f"{value * 1e3:.0f}"

    def share(values: list[float]) -> str:
        return f"{statistics.fmean(values):.2f}x" if values else "n/a"

    return [
        str(dp),
        f"{load:.0%}",
        o.target,
        str(len(o.ttfts)),
        str(o.errors),
        ms(statistics.fmean(o.ttfts)) if o.ttfts else "n/a",
        ms(_quantile(o.ttfts, 0.5)),
        ms(_quantile(o.ttfts, 0.99)),
        ms(statistics.fmean(o.latencies)) if o.latencies else "n/a",
        f"{ms(statistics.fmean(o.floors))} / {ms(_quantile(o.floors, 0.99))}"
        if o.floors
        else "n/a",
        f"{len(o.ttfts) / o.seconds:.1f}" if o.seconds else "n/a",
        f"{o.cached / o.prompt:.3f}" if o.prompt else "n/a",
        share(o.work_share),
        share(o.request_share),
        f"{statistics.fmean(max(b) for b in o.busy):.2f}" if o.busy else "n/a",
        str(o.preemptions),
    ]


async def run(args: argparse.Namespace, work_dir: Path) -> str:
    shape = Shape(
        prompts=args.prompts,
        zipf=args.zipf,
        system_tokens=(8192, 32768) if args.long else (1024, 3072),
        turns=args.turns,
        seed=args.seed,
        bursts=Bursts() if args.bursts else None,
    )
    systems = system_prompts(shape)
    model_dir = peers.model_dir(work_dir)
    targets = starters(args.policy, args.variant)
    rows: list[list[str]] = []
    for dp in args.dp:
        rate_full = args.session_rate
        if rate_full is None:
            with (
                mock_engine(args, dp, model_dir, calibrating=True) as (engine, process),
                ExitStack() as stack,
            ):
                gateway = targets["round_robin"](stack, engine)
                rate_full = await calibrate(
                    gateway, engine, process, systems, shape, args.calibrate_seconds
                )
            print(f"DP={dp}: round robin saturates at {rate_full:.2f} sessions/s", flush=True)
        for load in args.load:
            rate = rate_full * load
            plan = sessions(shape, rate, args.seconds, args.seed + dp)
            pooled: dict[str, Outcome] = {}
            for round_index in range(args.rounds):
                names = list(targets)
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    with (
                        mock_engine(args, dp, model_dir) as (engine, process),
                        ExitStack() as stack,
                    ):
                        gateway = targets[name](stack, engine)
                        outcome = await drive(gateway, engine, process, systems, plan, name)
                    pooled.setdefault(name, Outcome(name)).absorb(outcome)
                    print("  ".join(row(dp, load, outcome)), flush=True)
            rows.extend(row(dp, load, pooled[name]) for name in targets)
    title = (
        f"Production-shaped routing, mock engine (speed {args.speed}, block {BLOCK}, "
        f"{args.kv_blocks} KV blocks and {args.max_running} running per rank); "
        f"{args.prompts} system prompts of {shape.system_tokens[0]}-{shape.system_tokens[1]} "
        f"tokens, Zipf {args.zipf}, {args.turns} turns a session on average, Poisson arrivals "
        f"for {args.seconds:.0f} s; load: the share of time round robin keeps the ranks stepping; "
        f"{args.rounds} interleaved rounds, pooled; {peers.machine()}"
    )
    return peers.table(HEAD, rows, title, args.markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--load", type=float, nargs="+", default=[0.7, 0.9])
    parser.add_argument("--policy", nargs="+", default=["kv"], help="Rankgate policies")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also run Rankgate's kv policy with these gateway flags, as target 'rankgate NAME'",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=40.0, help="arrival window per run")
    parser.add_argument("--speed", type=float, default=0.2, help="mock timing (1.0 = GPU-like)")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks per rank (default 2048, with --long 8192: a rank holds the full context)",
    )
    parser.add_argument("--max-running", type=int, default=64, help="running requests per rank")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=1.3)
    parser.add_argument("--turns", type=float, default=3.0, help="mean turns a session")
    parser.add_argument("--long", action="store_true", help="8k-32k-token system prompts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--slow-rank", type=float, help="rank 0's speed factor, e.g. 0.4")
    parser.add_argument(
        "--bursts", action="store_true", help="on/off waves: 3.5 s at 2.5x the rate, 6.5 s at 0.19x"
    )
    parser.add_argument("--calibrate-seconds", type=float, default=20.0)
    parser.add_argument(
        "--session-rate",
        type=float,
        help="the rate round robin saturates at, in sessions/s (skips calibration)",
    )
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.kv_blocks is None:
        args.kv_blocks = 8192 if args.long else 2048
    with tempfile.TemporaryDirectory(prefix="production-routing-") as work:
        print(asyncio.run(run(args, Path(work))))


if __name__ == "__main__":
    main()
