"""Routing policies on the clock-free DP engine model, under production-shaped traffic.

The same workload as ``bench/production_routing.py`` (``tests/support/sessions.py``: Zipf-skewed
long system prompts, open-loop Poisson sessions of growing multi-turn contexts), on
``tests/support/rank_sim.py``'s model of a vLLM engine (FCFS, chunked prefill, bounded running
requests, an LRU prefix cache smaller than the working set, the mock engine's GPU-like step
times) instead of the live mock: simulated time stands still while the router decides, so DP 2
to 32 at three loads run in a minute, the same on any machine, and the engine, never the
gateway's CPU, is what saturates.

``--agents`` plays agent loops instead (``tests/support/sessions.AGENTS``: 16 agent definitions,
a dozen turns a session, each adding a tool result of up to 4k tokens) with 16384 KV blocks a
rank. Such sessions outlast the arrival window and round robin computes every history again, so
their load is measured on one rank, where no router has a choice: the work the window's
arrivals bring per second of arrivals, against what the ranks could do (``full_rate(offered=
True)``). Use ``--seconds 600``: a session runs for a minute or more.

Targets: Rankgate's ``kv`` policy (with its defaults, and with any ``--variant``), vllm-router's
``kv_aware`` rule (the longest cached prefix, load ignored, the least loaded rank when none has
any), and round robin. Loads are fractions of the session rate at which round robin keeps every
rank stepping all the time. Printed per target: TTFT mean, p50 and p99, mean end-to-end
latency, the engine's prefix-cache hit rate, the busiest rank's share of the prefill work and
of the requests (1.00 = even), and the busiest rank's share of time stepping.

Where the TTFT goes, per request: the floor, its least TTFT under any router (the rank idle
and holding every block an earlier request carried, only the rest prefilled, alone); the
seconds spent prefilling again blocks an earlier request had carried (evicted, or cached on
another rank), and of those the part some rank still held when the request was routed (what a
better choice could have saved; the rest was held nowhere: the caches' capacity); and the rest,
time spent waiting behind other work. No router goes below the
floor's mean, so it bounds what any lead over another router can be. With a slow rank the floor
is priced on the fastest rank, and what a request's own rank being slower added is its own term.

``--condition`` picks where a router can change latency (``tests/support/rank_bounds.py``):
``slow`` (rank 0 at 0.4x speed; ``--slow`` sets the factor), ``bursts`` (3.5 s at 2.5x the
mean rate, 6.5 s at 0.19x), ``small_kv`` (pooled KV a quarter of the trace's working set;
``--kv-fraction``), or ``friendly``. Each is calibrated as if every rank were equally fast.
Every table also prints the ceiling, the hit rate of the same trace through one LRU cache
holding all the ranks' blocks, and each router's share of the gap between round robin and the
bounds that it closes: of the mean TTFT down to the floor, and of the hit rate up to the
ceiling. ``--per-rank`` adds each rank's split of the TTFT.

    PYTHONPATH=. .venv/bin/python bench/routing_simulation.py [--dp 2 4 8 16 32] \\
        [--load 0.5 0.7 0.9] [--seconds 60] [--seeds 1 2 3] [--long | --agents] [--markdown] \\
        [--condition friendly slow bursts small_kv] [--per-rank] \\
        [--variant 'noshare=share_weight=0']
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence

import msgspec
import peers

from rankgate.sidecar.routing.config import RoutingConfig
from tests.support.rank_bounds import CONDITIONS, Condition, Setting, pooled_hit_rate, setting
from tests.support.rank_sim import EngineModel, Outcome, full_rate, run_plan
from tests.support.sessions import AGENTS, Shape

HEAD = [
    "DP", "load", "condition", "target", "requests", "mean TTFT ms", "p50 TTFT ms",
    "p99 TTFT ms", "mean e2e ms", "floor mean / p99 ms", "slow rank ms",
    "recompute ms (held when routed)", "wait ms", "hit rate", "ceiling hit",
    "gap closed TTFT / hit", "busiest rank work", "busiest rank requests", "busiest rank busy",
]  # fmt: skip
RANK_HEAD = [
    "DP", "condition", "target", "rank", "speed", "requests", "mean TTFT ms", "floor ms",
    "slow rank ms", "recompute ms", "wait ms", "busy",
]  # fmt: skip


def _variant(text: str) -> tuple[str, RoutingConfig]:
    name, _, assignments = text.partition("=")
    fields: dict[str, float] = {}
    for assignment in assignments.split(","):
        key, _, value = assignment.partition("=")
        fields[key.strip()] = float(value)
    return name, msgspec.structs.replace(RoutingConfig(), **fields)


def _ms(value: float) -> str:
    return f"{value * 1e3:.0f}"


class Pooled:
    """One target's runs of one configuration, pooled over the seeds."""

    def __init__(self, runs: Sequence[Outcome], capacity: int, block: int) -> None:
        self.runs = runs
        self.ttfts = [t for o in runs for t in o.ttfts]
        self.floors = [t for o in runs for t in o.floors]
        self.mean = statistics.fmean(self.ttfts)
        self.floor = statistics.fmean(self.floors)
        self.hit = sum(o.cached for o in runs) / sum(o.prompt for o in runs)
        self.ceiling = statistics.fmean(pooled_hit_rate(o.trace, capacity, block) for o in runs)

    def closed(self, baseline: Pooled) -> str:
        """The share of round robin's gap to the floor (TTFT) and ceiling (hit) closed."""
        ttft = (baseline.mean - self.mean) / (baseline.mean - self.floor)
        hit = (self.hit - baseline.hit) / (self.ceiling - baseline.hit)
        return f"{ttft:.0%} / {hit:.0%}"


def row(dp: int, load: float, where: str, name: str, pooled: Pooled, baseline: Pooled) -> list[str]:
    runs = pooled.runs
    latencies = [t for o in runs for t in o.latencies]
    recomputed = statistics.fmean(t for o in runs for t in o.recomputed)
    elsewhere = statistics.fmean(t for o in runs for t in o.recomputed_elsewhere)
    slowed = statistics.fmean(t for o in runs for t in o.slowed)
    ordered, floors = sorted(pooled.ttfts), sorted(pooled.floors)
    return [
        str(dp),
        f"{load:.0%}",
        where,
        name,
        str(len(ordered)),
        _ms(pooled.mean),
        _ms(ordered[round(0.5 * (len(ordered) - 1))]),
        _ms(ordered[round(0.99 * (len(ordered) - 1))]),
        _ms(statistics.fmean(latencies)),
        f"{_ms(pooled.floor)} / {_ms(floors[round(0.99 * (len(floors) - 1))])}",
        _ms(slowed),
        f"{_ms(recomputed)} / {_ms(elsewhere)}",
        _ms(pooled.mean - pooled.floor - slowed - recomputed),
        f"{pooled.hit:.3f}",
        f"{pooled.ceiling:.3f}",
        pooled.closed(baseline),
        f"{statistics.fmean(o.work_share for o in runs):.2f}x",
        f"{statistics.fmean(o.request_share for o in runs):.2f}x",
        f"{statistics.fmean(max(o.busy) for o in runs):.2f}",
    ]


def rank_rows(dp: int, where: str, name: str, runs: Sequence[Outcome]) -> list[list[str]]:
    """Each rank's requests and where their TTFT went, pooled over the seeds."""
    rows = []
    for slot in range(dp):
        picked = [
            (ttft, floor, slowed, recomputed)
            for o in runs
            for ttft, floor, slowed, recomputed, at in zip(
                o.ttfts, o.floors, o.slowed, o.recomputed, o.slots, strict=True
            )
            if at == slot
        ]
        if not picked:
            continue
        columns = zip(*picked, strict=True)
        ttft, floor, slowed, recomputed = (statistics.fmean(column) for column in columns)
        rows.append(
            [
                str(dp), where, name, str(slot), f"{runs[0].speeds[slot]:.2f}", str(len(picked)),
                _ms(ttft), _ms(floor), _ms(slowed), _ms(recomputed),
                _ms(ttft - floor - slowed - recomputed),
                f"{statistics.fmean(o.busy[slot] for o in runs):.2f}",
            ]
        )  # fmt: skip
    return rows


def _setting(
    args: argparse.Namespace, condition: Condition, dp: int, seed: int, load: float
) -> Setting:
    if args.agents:
        shape = dataclasses.replace(AGENTS, seed=seed)
        model = EngineModel(dp=dp, kv_blocks=args.kv_blocks or 16384)
        rate = full_rate(model, shape, 1200.0, offered=True) * load
        return Setting(model, shape, rate, 0)
    system = (8192, 32768) if args.long else (1024, 3072)
    shape = Shape(seed=seed, system_tokens=system)
    if args.slow is not None and condition.slow != 1.0:
        condition = dataclasses.replace(condition, slow=args.slow)
    if args.kv_fraction is not None and condition.kv_fraction is not None:
        condition = dataclasses.replace(condition, kv_fraction=args.kv_fraction)
    found = setting(condition, dp, shape, load)
    if args.kv_blocks is not None and condition.kv_fraction is None:
        model = dataclasses.replace(found.model, kv_blocks=args.kv_blocks)
        found = dataclasses.replace(found, model=model)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--load", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    parser.add_argument("--seconds", type=float, default=60.0, help="arrival window per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--kv-blocks", type=int, help="KV blocks per rank (default 2048; with --agents 16384)"
    )
    parser.add_argument("--long", action="store_true", help="8k-32k-token system prompts")
    parser.add_argument(
        "--agents", action="store_true", help="agent loops: 16 prompts, contexts growing to 64k"
    )
    parser.add_argument("--condition", nargs="+", choices=sorted(CONDITIONS), default=["friendly"])
    parser.add_argument("--slow", type=float, help="the slow rank's speed factor (0.4)")
    parser.add_argument("--kv-fraction", type=float, help="pooled KV / working set (0.25)")
    parser.add_argument("--per-rank", action="store_true", help="each rank's TTFT split")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FIELD=V,...")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    targets: list[tuple[str, str, RoutingConfig]] = [
        ("rankgate kv", "kv", RoutingConfig()),
        *(("rankgate " + name, "kv", config) for name, config in map(_variant, args.variant)),
        ("longest prefix (vllm-router kv_aware)", "longest_prefix", RoutingConfig()),
        ("round robin", "round_robin", RoutingConfig()),
    ]
    rows: list[list[str]] = []
    per_rank: list[list[str]] = []
    kv_blocks: set[int] = set()
    for key in args.condition:
        condition = CONDITIONS[key]
        for dp in args.dp:
            for load in args.load:
                runs: dict[str, list[Outcome]] = {name: [] for name, _, _ in targets}
                for seed in args.seeds:
                    found = _setting(args, condition, dp, seed, load)
                    model = found.model
                    for name, policy, config in targets:
                        outcome = run_plan(
                            model, policy, found.shape, found.rate, args.seconds, config
                        )
                        runs[name].append(outcome)
                kv_blocks.add(model.kv_blocks)
                capacity = dp * (model.kv_blocks - 1)
                pooled = {name: Pooled(runs[name], capacity, model.block_size) for name in runs}
                baseline = pooled["round robin"]
                for name, _, _ in targets:
                    rows.append(row(dp, load, condition.name, name, pooled[name], baseline))
                    print("  ".join(rows[-1]), flush=True)
                    if args.per_rank:
                        per_rank += rank_rows(dp, condition.name, name, runs[name])
    if args.agents:
        workload = "agent loops (16 prompts of 2k-8k tokens, Zipf 1.1, 12 turns of 256-4k tokens)"
    else:
        workload = f"64 system prompts, Zipf 1.3, {'8k-32k' if args.long else '1k-3k'} tokens"
    blocks = "/".join(map(str, sorted(kv_blocks)))
    title = (
        f"Routing on the simulated engine ({blocks} KV blocks and 64 running per "
        f"rank, the mock's step times at speed 0.5); {workload}; {args.seconds:.0f} s of Poisson "
        f"sessions per run, seeds {' '.join(map(str, args.seeds))} pooled"
    )
    print(peers.table(HEAD, rows, title, args.markdown))
    if per_rank:
        print(peers.table(RANK_HEAD, per_rank, "Where the TTFT went, per rank", args.markdown))


if __name__ == "__main__":
    main()
