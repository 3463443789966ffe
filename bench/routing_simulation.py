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
floor's mean, so it bounds what any lead over another router can be.

    PYTHONPATH=. .venv/bin/python bench/routing_simulation.py [--dp 2 4 8 16 32] \\
        [--load 0.5 0.7 0.9] [--seconds 60] [--seeds 1 2 3] [--long | --agents] [--markdown] \\
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
from tests.support.rank_sim import EngineModel, Outcome, full_rate, run_plan
from tests.support.sessions import AGENTS, Shape

HEAD = [
    "DP", "load", "target", "requests", "mean TTFT ms", "p50 TTFT ms", "p99 TTFT ms",
    "mean e2e ms", "floor mean / p99 ms", "recompute ms (held when routed)", "wait ms", "hit rate",
    "busiest rank work", "busiest rank requests", "busiest rank busy",
]  # fmt: skip


def _variant(text: str) -> tuple[str, RoutingConfig]:
    name, _, assignments = text.partition("=")
    fields: dict[str, float] = {}
    for assignment in assignments.split(","):
        key, _, value = assignment.partition("=")
        fields[key.strip()] = float(value)
    return name, msgspec.structs.replace(RoutingConfig(), **fields)


def row(dp: int, load: float, name: str, runs: Sequence[Outcome]) -> list[str]:
    ttfts = [t for o in runs for t in o.ttfts]
    latencies = [t for o in runs for t in o.latencies]
    floors = [t for o in runs for t in o.floors]
    recomputed = [t for o in runs for t in o.recomputed]
    elsewhere = [t for o in runs for t in o.recomputed_elsewhere]
    ordered = sorted(ttfts)

    def ms(value: float) -> str:
        return f"{value * 1e3:.0f}"

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return [
        str(dp),
        f"{load:.0%}",
        name,
        str(len(ttfts)),
        ms(statistics.fmean(ttfts)),
        ms(quantile(0.5)),
        ms(quantile(0.99)),
        ms(statistics.fmean(latencies)),
        f"{ms(statistics.fmean(floors))} / {ms(sorted(floors)[round(0.99 * (len(floors) - 1))])}",
        f"{ms(statistics.fmean(recomputed))} / {ms(statistics.fmean(elsewhere))}",
        ms(statistics.fmean(ttfts) - statistics.fmean(floors) - statistics.fmean(recomputed)),
        f"{sum(o.cached for o in runs) / sum(o.prompt for o in runs):.3f}",
        f"{statistics.fmean(o.work_share for o in runs):.2f}x",
        f"{statistics.fmean(o.request_share for o in runs):.2f}x",
        f"{statistics.fmean(max(o.busy) for o in runs):.2f}",
    ]


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
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FIELD=V,...")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.kv_blocks is None:
        args.kv_blocks = 16384 if args.agents else 2048
    targets: list[tuple[str, str, RoutingConfig]] = [
        ("rankgate kv", "kv", RoutingConfig()),
        *(("rankgate " + name, "kv", config) for name, config in map(_variant, args.variant)),
        ("longest prefix (vllm-router kv_aware)", "longest_prefix", RoutingConfig()),
        ("round robin", "round_robin", RoutingConfig()),
    ]
    rows: list[list[str]] = []
    for dp in args.dp:
        model = EngineModel(dp=dp, kv_blocks=args.kv_blocks)
        for load in args.load:
            runs: dict[str, list[Outcome]] = {name: [] for name, _, _ in targets}
            for seed in args.seeds:
                if args.agents:
                    shape = dataclasses.replace(AGENTS, seed=seed)
                else:
                    system = (8192, 32768) if args.long else (1024, 3072)
                    shape = Shape(seed=seed, system_tokens=system)
                rate = full_rate(model, shape, 1200.0 if args.agents else 60.0, args.agents) * load
                for name, policy, config in targets:
                    runs[name].append(run_plan(model, policy, shape, rate, args.seconds, config))
            for name, _, _ in targets:
                rows.append(row(dp, load, name, runs[name]))
                print("  ".join(rows[-1]), flush=True)
    if args.agents:
        workload = "agent loops (16 prompts of 2k-8k tokens, Zipf 1.1, 12 turns of 256-4k tokens)"
    else:
        workload = f"64 system prompts, Zipf 1.3, {'8k-32k' if args.long else '1k-3k'} tokens"
    title = (
        f"Routing on the simulated engine ({args.kv_blocks} KV blocks and 64 running per "
        f"rank, the mock's step times at speed 0.5); {workload}; {args.seconds:.0f} s of Poisson "
        f"sessions per run, seeds {' '.join(map(str, args.seeds))} pooled"
    )
    print(peers.table(HEAD, rows, title, args.markdown))


if __name__ == "__main__":
    main()
