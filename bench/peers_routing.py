"""Routing quality against peers: prefix hit rate, mean/p99 TTFT and throughput over HTTP.

The routing workloads of ``tests/routing/workload.py`` (shared-prefix multi-turn
conversations and one-turn requests with nothing in common), sent as token-id
``/v1/completions`` streams through each gateway in turn:

- Rankgate with each policy: ``kv``, ``load``, ``round_robin``, and ``engine`` (no rank pinned:
  vLLM's own balancer decides);
- vllm-router 0.1.17 with ``kv_aware`` (fed by the same KV events), and with ``--real`` also
  with ``round_robin``;
- with ``--real``, vLLM's own HTTP server (its frontend and DP balancer, no gateway);
- with ``--dynamo``, Dynamo 1.6.1's frontend and vLLM sidecar with its KV router
  (``--install-dynamo`` first builds its venv under ``~/.cache/rankgate/dynamo``).

Against the mock engine (default: DP=4, GPU-like timing slowed by ``--speed``), each target gets
a fresh engine in this process and the hit rate is the engine's own count (cached prompt
tokens / prompt tokens).

With ``--real``, one real vLLM server (DP=2, CPU build, tiny model stretched to
``--max-model-len``) serves every target, one after the other, over two workloads: ``shared``
(multi-turn conversations over a few system prompts) and ``prefill`` (long shared system
prompts, short turns, two-token answers: prefill dominates, so the hit rate shows in TTFT).
Before each pass vLLM's prefix cache is reset (``/reset_prefix_cache``) and the pass's prompts
start with a block of their own, so no target inherits another's cache. The hit rate is
vLLM's own: the difference of its ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``
counters around the run. Beside it: the router's own estimate (Rankgate: cached / prompt
tokens it believed at routing time) and the ceiling, the hit rate of one never-evicting cache
over the same prompts in the same order (``bench/prefix_ceiling.py``), which no routing can
beat.

TTFT is measured at the client, from sending the request to the first streamed chunk
(``tests.routing.workload.GatewayClient``, the routing tests' own HTTP client), latency to the
end of the stream; each is a mean over the pooled requests, with the 95% interval of the mean
across passes (the passes are interleaved, so the interval also takes in the machine's drift).
With ``--real``, vLLM's own mean TTFT (``vllm:time_to_first_token_seconds``: arrival in the
engine to first token) stands beside them, and everything runs under the fair placement of
``tests/support/placement.py``: vLLM on one CPU, the gateways and this client on the other,
because vLLM's CPU workers spin for a second after each step and would otherwise starve them
(``--placement shared`` for hit-rate-only runs, which do not need it).

    scripts/in-netns .venv/bin/python bench/peers_routing.py [--speed 0.1] [--markdown]
    flock /tmp/rankgate-vllm.lock scripts/in-netns .venv/bin/python bench/peers_routing.py \
        --real [--dynamo] [--markdown] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import httpx
import peers
from prefix_ceiling import CacheCounters, ceiling, read_counters
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(peers.ROOT))

from tests.routing.workload import (
    VOCAB,
    GatewayClient,
    NoReuse,
    PolicyResult,
    SharedPrefix,
    Workload,
    _shared,
    _unique,
    engine_config,
)
from tests.support.mock_engine import running_mock_engine
from tests.support.placement import SHARED, Placement, fair_placement

RANKGATE_POLICIES = ("kv", "load", "round_robin", "engine")
VLLM_OWN = "vLLM's own server"
# Rankgate's routing counters: prompt tokens routed, and those the chosen rank was believed
# to hold (the router's own estimate of the hit rate).
ROUTED_PROMPT = "rankgate_routing_prompt_tokens"
ROUTED_CACHED = "rankgate_routing_cached_tokens"


class Tagged:
    """A client whose prompts all start with a block of its own (real vLLM: one server serves
    every target, and no target may inherit another's cache); it keeps every prompt it sends,
    in sending order, for the ceiling."""

    def __init__(self, inner: GatewayClient, tag: Sequence[int]) -> None:
        self.inner = inner
        self.tag = list(tag)
        self.sent: list[list[int]] = []
        self.latencies: list[float] = []

    async def complete(
        self, request_id: str, prompt: Sequence[int], out: int
    ) -> tuple[float, list[int]]:
        tagged = [*self.tag, *prompt]
        self.sent.append(tagged)
        started = time.perf_counter()
        answer = await self.inner.complete(request_id, tagged, out)
        self.latencies.append(time.perf_counter() - started)
        return answer


@dataclasses.dataclass
class Run:
    """One target's passes over one workload, and what they proved: the engine's own cache
    counts, the router's estimate of them (None: the router does not tell), the ceiling."""

    name: str
    work: Workload
    result: PolicyResult
    measured: CacheCounters | None = None
    estimated: CacheCounters | None = None
    best: CacheCounters | None = None
    # Each pass's busiest rank share: pooled counts would hide a pass that piled onto rank 0
    # behind one that piled onto rank 1.
    shares: list[float] = dataclasses.field(default_factory=list)
    latencies: list[float] = dataclasses.field(default_factory=list)
    # Each pass's mean TTFT and mean latency, for the spread between passes.
    pass_ttft: list[float] = dataclasses.field(default_factory=list)
    pass_latency: list[float] = dataclasses.field(default_factory=list)

    def close(self) -> Run:
        share = None if self.measured is None else self.measured.busiest_share
        if share is not None:
            self.shares.append(share)
        if self.result.ttfts:
            self.pass_ttft.append(self.result.mean_ttft)
        if self.latencies:
            self.pass_latency.append(statistics.fmean(self.latencies))
        return self

    def absorb(self, other: Run) -> None:
        """Pool another pass of the same target: counts add up, TTFT samples join."""
        self.result.requests += other.result.requests
        self.result.seconds += other.result.seconds
        self.result.ttfts.extend(other.result.ttfts)
        self.measured = _add(self.measured, other.measured)
        self.estimated = _add(self.estimated, other.estimated)
        self.best = _add(self.best, other.best)
        self.shares.extend(other.shares)
        self.latencies.extend(other.latencies)
        self.pass_ttft.extend(other.pass_ttft)
        self.pass_latency.extend(other.pass_latency)

    def row(self) -> list[str]:
        result = self.result
        throughput = result.requests / result.seconds if result.seconds else 0.0
        return [
            self.work.name,
            self.name,
            str(result.requests),
            _percent(self.measured),
            _percent(self.estimated),
            _percent(self.best),
            f"{sum(self.shares) / len(self.shares):.0%}" if self.shares else "n/a",
            _mean_ms(result.ttfts, self.pass_ttft),
            f"{result.p99_ttft * 1e3:.1f}",
            _mean_ms(self.latencies, self.pass_latency),
            _engine_ttft(self.measured),
            f"{throughput:.2f}",
            f"{result.seconds:.1f}",
        ]


def _add(a: CacheCounters | None, b: CacheCounters | None) -> CacheCounters | None:
    return None if a is None or b is None else a + b


def _mean_ms(samples: Sequence[float], passes: Sequence[float]) -> str:
    """The pooled mean, and with several passes the 95% interval of the mean across them."""
    if not samples:
        return "n/a"
    mean = f"{statistics.fmean(samples) * 1e3:.1f}"
    if len(passes) < 2:
        return mean
    half = T95[min(len(passes) - 1, len(T95)) - 1] * statistics.stdev(passes)
    return f"{mean} ± {half / math.sqrt(len(passes)) * 1e3:.1f}"


# Student's t, two-sided 95%, for 1..10 degrees of freedom (the last also serves beyond).
T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23)


def _engine_ttft(counters: CacheCounters | None) -> str:
    mean = None if counters is None else counters.engine_ttft
    return "n/a" if mean is None else f"{mean * 1e3:.1f}"


def _percent(counters: CacheCounters | None) -> str:
    rate = None if counters is None else counters.hit_rate
    return "n/a" if rate is None else f"{rate:.1%}"


HEAD = [
    "workload", "target", "requests", "hit rate", "router estimate", "ceiling",
    "busiest rank (mean of passes)", "mean TTFT ms", "p99 TTFT ms", "mean latency ms",
    "vLLM's mean TTFT ms",
    "req/s", "wall s",
]  # fmt: skip


async def run_workload(
    gateway: peers.Gateway, model: str, work: Workload, result: PolicyResult, tag: Sequence[int]
) -> Tagged:
    """Drive ``work`` through ``gateway``; the client returned kept every prompt, in the order
    they were sent, and every request's latency."""
    # Idle connections are dropped before any gateway's keep-alive timeout (uvicorn: 5 s) can
    # close one under a request that is just being sent on it.
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256, keepalive_expiry=2.0)
    async with httpx.AsyncClient(
        base_url=gateway.url, headers=gateway.headers, timeout=120.0, limits=limits
    ) as http:
        client = Tagged(GatewayClient(http, model), tag)
        started = time.perf_counter()
        if isinstance(work, SharedPrefix):
            await _shared(client, work, result)
        else:
            await _unique(client, work, result)
        result.seconds = time.perf_counter() - started
    return client


async def routed_tokens(gateway: peers.Gateway) -> CacheCounters | None:
    """Rankgate's routed prompt tokens and believed-cached tokens; None for other gateways."""
    if not gateway.name.startswith("rankgate"):
        return None
    async with httpx.AsyncClient(headers=gateway.headers, timeout=10.0) as http:
        response = await http.get(f"{gateway.url}/metrics")
    response.raise_for_status()
    totals = {ROUTED_PROMPT: 0.0, ROUTED_CACHED: 0.0}
    for family in text_string_to_metric_families(response.text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return CacheCounters(queries=totals[ROUTED_PROMPT], hits=totals[ROUTED_CACHED])


def _difference(before: CacheCounters | None, after: CacheCounters | None) -> CacheCounters | None:
    return None if before is None or after is None else after - before


Starter = Callable[[ExitStack, peers.Engine], peers.Gateway]


def _rankgate(
    stack: ExitStack, engine: peers.Engine, policy: str, extra: Sequence[str] = ()
) -> peers.Gateway:
    return peers.start_rankgate(stack, engine, policy, extra)


# Real vLLM on two busy cores can take over a second to answer a health check; the default
# 1 s probe deadline would then take the engine out of service for a moment (503s).
REAL_RANKGATE_FLAGS = ("--health-interval", "5")


def starters(args: argparse.Namespace, work_dir: Path) -> dict[str, Starter]:
    found: dict[str, Starter] = {}
    extra = REAL_RANKGATE_FLAGS if args.real else ()
    for policy in args.policy:
        found[f"rankgate {policy}"] = functools.partial(_rankgate, policy=policy, extra=extra)
    found["vllm-router kv_aware"] = lambda s, e: peers.start_vllm_router(s, e, "kv_aware")
    if args.real:
        found["vllm-router round_robin"] = lambda s, e: peers.start_vllm_router(s, e, "round_robin")
        # Set by main_real once the server is up: no gateway, vLLM's own frontend.
        found[VLLM_OWN] = lambda s, e: peers.Gateway(VLLM_OWN, args.vllm_http, [])
    if args.dynamo:
        found["dynamo kv"] = lambda s, e: peers.start_dynamo(s, e, work_dir, "kv")
    return found


def not_run(work: Workload, name: str, why: str) -> list[str]:
    return [work.name, name, f"not run: {why}", *[""] * (len(HEAD) - 3)]


def tag_block(label: str, block_size: int) -> list[int]:
    """A block of tokens that only ``label``'s prompts start with."""
    rng = random.Random(label)
    return [rng.randrange(*VOCAB) for _ in range(block_size)]


async def one_mock(
    name: str, start: Starter, work: Workload, args: argparse.Namespace, model_dir: Path
) -> Run:
    config = dataclasses.replace(
        engine_config(args.speed, work.kv_blocks_per_rank),
        tokenizer=str(model_dir),
        model_id=str(model_dir),
        # A rank must hold the whole context (the engine refuses to start otherwise).
        max_model_len=min(8192, work.kv_blocks_per_rank * 16),
    )
    run = Run(name, work, PolicyResult(policy=name, workload=work.name))
    with running_mock_engine(config) as handle:
        engine = peers.Engine(
            handle.target, config.dp_size, config.block_size, config.model, model_dir,
            config.kv_events_port,
        )  # fmt: skip
        with ExitStack() as stack:
            gateway = start(stack, engine)
            # Start-up probes (vllm-router, Dynamo) must not count.
            before = await asyncio.to_thread(handle.all_stats)
            routed = await routed_tokens(gateway)
            client = await run_workload(gateway, engine.model, work, run.result, ())
            run.estimated = _difference(routed, await routed_tokens(gateway))
        after = await asyncio.to_thread(handle.all_stats)
    sent, run.latencies = client.sent, client.latencies
    prompt = sum(after[r].prompt_tokens - before[r].prompt_tokens for r in after)
    cached = sum(after[r].cached_tokens - before[r].cached_tokens for r in after)
    run.result.requests = sum(
        after[r].requests_received - before[r].requests_received for r in after
    )
    by_rank = tuple(float(after[r].prompt_tokens - before[r].prompt_tokens) for r in sorted(after))
    run.measured = CacheCounters(queries=prompt, hits=cached, by_engine=by_rank)
    run.best = ceiling(sent, config.block_size)
    return run.close()


BLOCK = 32


async def reset_prefix_cache(http: httpx.AsyncClient, base_url: str) -> None:
    response = await http.post(f"{base_url}/reset_prefix_cache")
    if response.status_code != 200:
        raise RuntimeError(
            f"vLLM refused /reset_prefix_cache: {response.status_code} {response.text[:200]}"
        )


async def one_real(
    name: str,
    gateway: peers.Gateway,
    engine: peers.Engine,
    work: Workload,
    tag: Sequence[int],
    vllm_http: str,
) -> Run:
    """One pass of ``work`` through a running gateway, on a freshly reset prefix cache."""
    run = Run(name, work, PolicyResult(policy=name, workload=work.name))
    async with httpx.AsyncClient(timeout=30.0) as http:
        # After the gateway's start-up probes and the previous pass: nothing left behind.
        await reset_prefix_cache(http, vllm_http)
        before = await read_counters(http, vllm_http)
        routed = await routed_tokens(gateway)
        client = await run_workload(gateway, engine.model, work, run.result, tag)
        run.estimated = _difference(routed, await routed_tokens(gateway))
        run.measured = await read_counters(http, vllm_http) - before
    run.latencies = client.latencies
    run.result.requests = len(run.result.ttfts)
    run.best = ceiling(client.sent, BLOCK)
    return run.close()


async def main_mock(args: argparse.Namespace, work_dir: Path) -> str:
    model_dir = peers.model_dir(work_dir)
    workloads: dict[str, Workload] = {"shared": SharedPrefix(), "unique": NoReuse()}
    rows: list[list[str]] = []
    for wname in args.workload:
        work = workloads[wname]
        targets = starters(args, work_dir)
        names = list(targets)
        pooled: dict[str, Run] = {}
        failed: dict[str, list[str]] = {}
        for round_ in range(args.rounds):
            # Every other round runs backwards, as with real vLLM: no target always runs
            # first or last while the machine's other load comes and goes.
            for name in names[::-1] if round_ % 2 else names:
                if name in failed:
                    continue
                try:
                    run = await one_mock(name, targets[name], work, args, model_dir)
                except peers.Unavailable as exc:
                    failed[name] = not_run(work, name, str(exc))
                    print("  ".join(failed[name]), flush=True)
                    continue
                print(f"round {round_ + 1}: " + "  ".join(run.row()), flush=True)
                if name in pooled:
                    pooled[name].absorb(run)
                else:
                    pooled[name] = run
        rows += [failed[name] if name in failed else pooled[name].row() for name in names]
    title = (
        f"Routing quality, mock engine DP=4 (speed {args.speed}), block 16; {args.rounds} "
        f"interleaved passes per target, each on a fresh engine, pooled; {peers.machine()}"
    )
    return peers.table(HEAD, rows, title, args.markdown)


def real_workloads(args: argparse.Namespace) -> dict[str, SharedPrefix]:
    """Sized so that routing decides the hit rate: many concurrent conversations over a few
    shared system prompts, every prompt within ``--max-model-len``. ``prefill``: prompts four
    times as long against two-token answers, so that prefill is most of every request."""
    shared = SharedPrefix(
        conversations=args.conversations,
        turns=args.turns,
        groups=args.groups,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        output_tokens=8,
        think_seconds=args.think_seconds,
        stagger_seconds=args.stagger_seconds,
    )
    prefill = dataclasses.replace(
        shared,
        turns=3,
        system_tokens=args.prefill_system_tokens,
        user_tokens=args.user_tokens // 2,
        output_tokens=2,
        name="prefill",
    )
    for work in (shared, prefill):
        longest = BLOCK + work.system_tokens + work.turns * work.user_tokens + work.output_tokens
        if longest > args.max_model_len:
            raise SystemExit(
                f"{work.name}: the last turn needs {longest} tokens, over --max-model-len "
                f"{args.max_model_len}"
            )
    return {"shared": shared, "prefill": prefill}


async def main_real(args: argparse.Namespace, work_dir: Path, placement: Placement) -> str:
    from tests.support.real_vllm import start_real_vllm

    workloads = real_workloads(args)
    rows: list[list[str]] = []
    with start_real_vllm(
        dp_size=2,
        block_size=BLOCK,
        max_model_len=args.max_model_len,
        dev_endpoints=True,
        nice=args.vllm_nice,
        cpus=placement.engine_cpus,
    ) as server:
        args.vllm_http = server.http_url
        engine = peers.Engine(
            server.target, server.dp_size, server.block_size, server.served_model_name,
            peers.model_dir(work_dir, server.model_dir), server.kv_events_base_port,
        )  # fmt: skip
        targets = starters(args, work_dir)
        # A fresh server's first streams are slow (CPU kernels warming up): one unrecorded
        # pass over every rank first, with a tag of its own, so the first target isn't billed.
        warm_work = dataclasses.replace(workloads["shared"], conversations=8, turns=2)
        try:
            with ExitStack() as stack:
                warm = peers.start_rankgate(stack, engine, "round_robin", REAL_RANKGATE_FLAGS)
                tag = tag_block("warm-up", BLOCK)
                await one_real("warm-up", warm, engine, warm_work, tag, server.http_url)
        except (httpx.HTTPError, RuntimeError) as exc:
            print(f"warm-up failed ({exc!r}); measuring anyway", flush=True)
        pooled: dict[tuple[str, str], Run] = {}
        failed: dict[str, str] = {}
        names = list(targets)
        for round_ in range(args.rounds):
            # Every other round runs backwards, so no target always runs first or last
            # while the machine's other load comes and goes.
            for name in names[::-1] if round_ % 2 else names:
                if name in failed:
                    continue
                try:
                    await real_round(name, targets[name], engine, workloads, args, round_, pooled)
                except peers.Unavailable as exc:
                    failed[name] = f"not run: {exc}"
                except TimeoutError:
                    failed[name] = f"failed: over {args.target_timeout:.0f} s"
                except (httpx.HTTPError, RuntimeError) as exc:
                    failed[name] = f"failed: {exc!r}"
                if name in failed:
                    print(f"round {round_ + 1}: {name}: {failed[name]}", flush=True)
    for wname in args.workload:
        for name in names:
            if name in failed:
                rows.append([wname, name, failed[name], *[""] * (len(HEAD) - 3)])
            elif (wname, name) in pooled:
                rows.append(pooled[(wname, name)].row())
    shared, prefill = workloads["shared"], workloads["prefill"]
    title = (
        f"Routing quality, real vLLM 0.32 CPU (DP=2, tiny model, {args.max_model_len}-token "
        f"context), block {BLOCK}, {placement.describe()}; {shared.conversations} "
        f"conversations over {shared.groups} system prompts, {shared.think_seconds:g} s think "
        f"time; shared: {shared.turns} turns, {shared.system_tokens}-token system prompts, "
        f"{shared.user_tokens} new tokens a turn, {shared.output_tokens}-token answers; "
        f"prefill: {prefill.turns} turns, {prefill.system_tokens}-token system prompts, "
        f"{prefill.user_tokens} new tokens a turn, {prefill.output_tokens}-token answers; "
        f"{args.rounds} interleaved passes per target, pooled; {peers.machine()}"
    )
    return peers.table(HEAD, rows, title, args.markdown)


async def real_round(
    name: str,
    start: Starter,
    engine: peers.Engine,
    workloads: dict[str, SharedPrefix],
    args: argparse.Namespace,
    round_: int,
    pooled: dict[tuple[str, str], Run],
) -> None:
    """One pass of every workload through one freshly started target."""
    with ExitStack() as stack:
        gateway = start(stack, engine)
        for wname in args.workload:
            # A first block of its own per pass: nothing inherits another's cache.
            tag = tag_block(f"{wname}/{name}/{round_}", BLOCK)
            passed = one_real(name, gateway, engine, workloads[wname], tag, args.vllm_http)
            run = await asyncio.wait_for(passed, args.target_timeout)
            print(f"round {round_ + 1}: " + "  ".join(run.row()), flush=True)
            if (wname, name) in pooled:
                pooled[(wname, name)].absorb(run)
            else:
                pooled[(wname, name)] = run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=0.1, help="mock timing (1.0 = GPU-like)")
    parser.add_argument(
        "--workload",
        nargs="+",
        help="shared, unique (default: both); with --real: shared, prefill (default: both)",
    )
    parser.add_argument("--policy", nargs="+", default=list(RANKGATE_POLICIES))
    parser.add_argument("--dynamo", action="store_true", help="add Dynamo's KV router")
    parser.add_argument(
        "--install-dynamo",
        action="store_true",
        help=f"first create Dynamo's venv in {peers.DYNAMO_VENV} if missing (implies --dynamo)",
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=2, help="passes per target, interleaved and pooled"
    )
    real = parser.add_argument_group("real vLLM")
    real.add_argument("--real", action="store_true", help="against real vLLM (DP=2)")
    real.add_argument("--max-model-len", type=int, default=2048)
    real.add_argument("--conversations", type=int, default=16)
    real.add_argument("--turns", type=int, default=4)
    real.add_argument("--groups", type=int, default=4, help="distinct system prompts")
    real.add_argument("--system-tokens", type=int, default=576)
    real.add_argument(
        "--prefill-system-tokens", type=int, default=1536, help="system prompt of 'prefill'"
    )
    real.add_argument("--user-tokens", type=int, default=160)
    real.add_argument("--think-seconds", type=float, default=1.0)
    real.add_argument(
        "--stagger-seconds",
        type=float,
        default=0.3,
        help="between conversation starts: long enough that a system prompt is computed "
        "before the next conversation that shares it arrives (or no router could hit it)",
    )
    real.add_argument(
        "--placement",
        choices=["fair", "shared"],
        default="fair",
        help="fair: vLLM on the first CPU, gateways and this client on the second "
        "(tests/support/placement.py); shared: nothing pinned, for hit-rate-only runs",
    )
    real.add_argument("--vllm-nice", type=int, default=0, help="vLLM's niceness")
    real.add_argument(
        "--target-timeout", type=float, default=120.0, help="seconds one pass may take"
    )
    args = parser.parse_args()
    if args.workload is None:
        args.workload = ["shared", "prefill"] if args.real else ["shared", "unique"]
    if args.install_dynamo:
        peers.install_dynamo()
        args.dynamo = True
    with tempfile.TemporaryDirectory(prefix="rankgate-peers-") as tmp:
        if args.real:
            placement = fair_placement() if args.placement == "fair" else SHARED
            if args.placement == "fair" and not placement.pinned:
                raise SystemExit("the fair placement needs two CPUs")
            if placement.pinned:
                # Before anything starts: the gateways and this client inherit the mask;
                # scripts/real-vllm moves vLLM to its own CPU.
                os.sched_setaffinity(0, placement.gateway)
            table = asyncio.run(main_real(args, Path(tmp), placement))
        else:
            table = asyncio.run(main_mock(args, Path(tmp)))
    print()
    print(table)


if __name__ == "__main__":
    main()
