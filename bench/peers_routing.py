"""Routing quality against peers: prefix hit rate, mean/p99 TTFT and throughput over HTTP.

The routing workloads of ``tests/routing/workload.py`` (shared-prefix multi-turn
conversations and one-turn requests with nothing in common, same parameters and seeds), sent
as token-id ``/v1/completions`` streams through each gateway in turn:

- Rankgate with each policy: ``kv``, ``load``, ``round_robin``, and ``engine`` (no rank pinned:
  vLLM's own balancer decides);
- vllm-router 0.1.17 with ``kv_aware`` (fed by the same KV events);
- with ``--dynamo``, Dynamo 1.6.1's frontend and vLLM sidecar with its KV router.

Against the mock engine (default: DP=4, GPU-like timing slowed by ``--speed``), each target gets
a fresh engine in this process and the hit rate is the engine's own count (cached prompt
tokens / prompt tokens). With ``--real``, one real vLLM server (DP=2, CPU build, tiny model)
serves every target; each target's prompts start with their own first block so no target
inherits another's cache, and the workloads shrink to fit its 512-token context. Real vLLM
does not report its cache counters over gRPC, so the hit rate column reads n/a there.

TTFT is measured at the client, from sending the request to the first streamed chunk
(``tests.routing.workload.GatewayClient``, the routing tests' own HTTP client).

    scripts/in-netns .venv/bin/python bench/peers_routing.py [--speed 0.1] [--markdown]
    scripts/in-netns .venv/bin/python bench/peers_routing.py --real
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import httpx
import peers

sys.path.insert(0, str(peers.ROOT))

from mocker.testing import running_mock_engine
from tests.routing.workload import (
    Client,
    GatewayClient,
    NoReuse,
    PolicyResult,
    SharedPrefix,
    Workload,
    _shared,
    _unique,
    engine_config,
)

RANKGATE_POLICIES = ("kv", "load", "round_robin", "engine")
FIRST_ID = 100


class Tagged:
    """A client whose prompts all start with a block of its own (real vLLM: one server serves
    every target, and no target may inherit another's cache)."""

    def __init__(self, inner: GatewayClient, tag: Sequence[int]) -> None:
        self.inner = inner
        self.tag = list(tag)

    async def complete(
        self, request_id: str, prompt: Sequence[int], out: int
    ) -> tuple[float, list[int]]:
        return await self.inner.complete(request_id, [*self.tag, *prompt], out)


async def run_workload(
    gateway: peers.Gateway, model: str, work: Workload, result: PolicyResult, tag: Sequence[int]
) -> None:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        base_url=gateway.url, headers=gateway.headers, timeout=120.0, limits=limits
    ) as http:
        client: Client = Tagged(GatewayClient(http, model), tag)
        started = time.perf_counter()
        if isinstance(work, SharedPrefix):
            await _shared(client, work, result)
        else:
            await _unique(client, work, result)
        result.seconds = time.perf_counter() - started


Starter = Callable[[ExitStack, peers.Engine], peers.Gateway]


def _rankgate(stack: ExitStack, engine: peers.Engine, policy: str) -> peers.Gateway:
    return peers.start_rankgate(stack, engine, policy)


def starters(args: argparse.Namespace, work_dir: Path) -> dict[str, Starter]:
    found: dict[str, Starter] = {}
    for policy in args.policy:
        found[f"rankgate {policy}"] = functools.partial(_rankgate, policy=policy)
    found["vllm-router kv_aware"] = lambda s, e: peers.start_vllm_router(s, e, "kv_aware")
    if args.dynamo:
        found["dynamo kv"] = lambda s, e: peers.start_dynamo(s, e, work_dir, "kv")
    return found


def row(name: str, work: Workload, result: PolicyResult, hit: str) -> list[str]:
    throughput = result.requests / result.seconds if result.seconds else 0.0
    return [
        work.name,
        name,
        str(result.requests),
        hit,
        f"{result.mean_ttft * 1e3:.1f}",
        f"{result.p99_ttft * 1e3:.1f}",
        f"{throughput:.2f}",
        f"{result.seconds:.1f}",
    ]


HEAD = [
    "workload", "target", "requests", "hit rate", "mean TTFT ms", "p99 TTFT ms", "req/s", "wall s",
]  # fmt: skip


async def one_mock(
    name: str, start: Starter, work: Workload, args: argparse.Namespace, model_dir: Path
) -> list[str]:
    config = dataclasses.replace(
        engine_config(args.speed, work.kv_blocks_per_rank),
        tokenizer=str(model_dir),
        model_id=str(model_dir),
        max_model_len=8192,
    )
    result = PolicyResult(policy=name, workload=work.name)
    with running_mock_engine(config) as handle:
        engine = peers.Engine(
            handle.target, config.dp_size, config.block_size, config.model, model_dir,
            config.kv_events_port,
        )  # fmt: skip
        with ExitStack() as stack:
            gateway = start(stack, engine)
            # Start-up probes (vllm-router, Dynamo) must not count.
            before = await asyncio.to_thread(handle.all_stats)
            await run_workload(gateway, engine.model, work, result, ())
        after = await asyncio.to_thread(handle.all_stats)
    prompt = sum(after[r].prompt_tokens - before[r].prompt_tokens for r in after)
    cached = sum(after[r].cached_tokens - before[r].cached_tokens for r in after)
    result.requests = sum(after[r].requests_received - before[r].requests_received for r in after)
    return row(name, work, result, f"{cached / prompt:.1%}" if prompt else "n/a")


async def one_real(
    name: str, start: Starter, work: Workload, engine: peers.Engine, tag: Sequence[int]
) -> list[str]:
    with ExitStack() as stack:
        result = PolicyResult(policy=name, workload=work.name)
        await run_workload(start(stack, engine), engine.model, work, result, tag)
    result.requests = len(result.ttfts)
    return row(name, work, result, "n/a")


def render(rows: list[list[str]], title: str, markdown: bool) -> str:
    lines = [title, ""]
    if markdown:
        lines.append("| " + " | ".join(HEAD) + " |")
        lines.append("|" + "---|" * len(HEAD))
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [HEAD, *rows]) for i in range(len(HEAD))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(HEAD, widths, strict=True)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


async def main_mock(args: argparse.Namespace, work_dir: Path) -> str:
    model_dir = peers.model_dir(work_dir)
    workloads: dict[str, Workload] = {"shared": SharedPrefix(), "unique": NoReuse()}
    rows: list[list[str]] = []
    for wname in args.workload:
        for name, start in starters(args, work_dir).items():
            try:
                rows.append(await one_mock(name, start, workloads[wname], args, model_dir))
            except peers.Unavailable as exc:
                rows.append([wname, name, f"not run: {exc}", "", "", "", "", ""])
            print("  ".join(rows[-1]), flush=True)
    title = f"Routing quality, mock engine DP=4 (speed {args.speed}), block 16; {peers.machine()}"
    return render(rows, title, args.markdown)


async def main_real(args: argparse.Namespace, work_dir: Path) -> str:
    from tests.support.real_vllm import start_real_vllm

    workloads: dict[str, Workload] = {
        "shared": SharedPrefix(conversations=6, turns=4, system_tokens=96, user_tokens=48),
        "unique": NoReuse(requests=24, min_tokens=64, max_tokens=400, interval_seconds=0.5),
    }
    rows: list[list[str]] = []
    with start_real_vllm(dp_size=2, block_size=32) as server:
        engine = peers.Engine(
            server.target, server.dp_size, server.block_size, server.served_model_name,
            peers.model_dir(work_dir, server.model_dir), server.kv_events_base_port,
        )  # fmt: skip
        targets = starters(args, work_dir)
        # A fresh server's first streams are slow (CPU kernels warming up): one unrecorded
        # pass over every rank first, with a tag of its own, so the first target isn't billed.
        warm = functools.partial(_rankgate, policy="round_robin")
        warm_tag = [FIRST_ID + 99 + j % 3 for j in range(server.block_size)]
        await one_real("warm-up", warm, workloads["shared"], engine, warm_tag)
        for wname in args.workload:
            for index, (name, start) in enumerate(targets.items()):
                # A first block of its own per target: no target inherits another's cache.
                tag = [FIRST_ID + 7 * index + j % 5 for j in range(server.block_size)]
                try:
                    rows.append(await one_real(name, start, workloads[wname], engine, tag))
                except peers.Unavailable as exc:
                    rows.append([wname, name, f"not run: {exc}", "", "", "", "", ""])
                print("  ".join(rows[-1]), flush=True)
    title = f"Routing quality, real vLLM 0.32 CPU (DP=2, tiny model), block 32; {peers.machine()}"
    return render(rows, title, args.markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=0.1, help="mock timing (1.0 = GPU-like)")
    parser.add_argument("--workload", nargs="+", default=["shared", "unique"])
    parser.add_argument("--policy", nargs="+", default=list(RANKGATE_POLICIES))
    parser.add_argument("--dynamo", action="store_true", help="add Dynamo's KV router")
    parser.add_argument("--real", action="store_true", help="against real vLLM (DP=2)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rankgate-peers-") as tmp:
        run = main_real if args.real else main_mock
        table = asyncio.run(run(args, Path(tmp)))
    print()
    print(table)


if __name__ == "__main__":
    main()
