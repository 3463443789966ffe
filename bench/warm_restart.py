"""Cache hits right after a gateway restart, with and without the saved KV index.

A rolling update replaces the gateway while the engine keeps running. Conversations started
before it send their next turn to the new gateway; whether that turn lands on the rank that
holds its history depends on what the new gateway knows of the caches. It joins the KV-event
streams mid-way: without ``--route-index-file`` it knows only what vLLM's replay buffer still
holds (the last ``--replay-batches`` batches of each rank), with it the index saved by the old
gateway plus a replay of what was published in between.

On the mock engine (DP ranks, KV events, a bounded replay buffer): ``--conversations`` first
turns through the first gateway, filler traffic past the replay buffer, a restart, then every
conversation's second turn through the new gateway at once. Prints the second turns' engine
hit rate (prompt tokens the engine found cached, by its own counters) and the share routed to
the rank holding their history, for each configuration in interleaved rounds.

    PYTHONPATH=. .venv/bin/python bench/warm_restart.py --rounds 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.mock_engine import MockEngineHandle, kv_mock_config, running_mock_engine

MODEL = "restart-bench"
BLOCK = 16


def gateway(engine: MockEngineHandle, index: str | None) -> Any:
    argv = ["serve", "--engine", engine.target, "--tokenizer", str(TINY_TOKENIZER)]
    argv += ["--startup-timeout", "30"]
    if index is not None:
        argv += ["--route-index-file", index]
    return serve_app(create_app(settings_from_args(build_parser().parse_args(argv))))


def history(n: int, turn: int) -> list[int]:
    """Conversation ``n`` up to ``turn``: a 40-block history, a few blocks more per turn."""
    length = (40 + 4 * turn) * BLOCK
    return [300 + (n * 7919 + i * 104729) % 2700 for i in range(length)]


def send(http: httpx.Client, ids: list[int], request_id: str) -> int:
    response = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ids, "max_tokens": 1, "request_id": request_id},
    )
    response.raise_for_status()
    return int(response.headers["x-rankgate-route"].split("rank=")[1].split(";")[0])


def wait_indexed(http: httpx.Client, blocks: float) -> None:
    deadline = time.monotonic() + 30
    while True:
        total = 0.0
        for line in http.get("/metrics").text.splitlines():
            if line.startswith('rankgate_routing_index_blocks{medium="device"'):
                total += float(line.rsplit(" ", 1)[1])
        if total >= blocks or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def one_restart(args: argparse.Namespace, saved: bool, round_no: int) -> tuple[float, float]:
    config = kv_mock_config(
        MODEL, dp_size=args.dp, block_size=BLOCK, kv_replay_buffer_steps=args.replay_batches
    )
    with tempfile.TemporaryDirectory() as scratch, running_mock_engine(config) as engine:
        index = str(Path(scratch) / "kv-index") if saved else None
        offset = round_no * 100_000
        holders: dict[int, int] = {}
        with gateway(engine, index) as url, httpx.Client(base_url=url, timeout=60) as http:
            for n in range(args.conversations):
                holders[n] = send(http, history(offset + n, 0), f"first-{n}")
            for n in range(args.filler):
                send(http, history(offset + 50_000 + n, 0)[: 2 * BLOCK], f"filler-{n}")
            wait_indexed(http, args.conversations * 40)
        before = engine.all_stats()
        with (
            gateway(engine, index) as url,
            httpx.Client(base_url=url, timeout=60) as http,
            ThreadPoolExecutor(8) as pool,
        ):
            ranks = list(
                pool.map(
                    lambda n: send(http, history(offset + n, 1), f"second-{n}"),
                    range(args.conversations),
                )
            )
        after = engine.all_stats()
    prompt = sum(after[r].prompt_tokens - before[r].prompt_tokens for r in after)
    cached = sum(after[r].cached_tokens - before[r].cached_tokens for r in after)
    followed = sum(rank == holders[n] for n, rank in enumerate(ranks))
    return cached / max(prompt, 1), followed / args.conversations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--filler", type=int, default=200, help="requests after the first turns")
    parser.add_argument("--replay-batches", type=int, default=64, help="vLLM's replay buffer")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for round_no in range(args.rounds):
        for saved in (False, True):
            rows[saved].append(one_restart(args, saved, round_no))
    print(
        f"Second turns right after a gateway restart: DP={args.dp}, {args.conversations} "
        f"conversations of 40+ blocks, {args.filler} requests after their first turns, a replay "
        f"buffer of {args.replay_batches} batches per rank; {args.rounds} interleaved rounds"
    )
    head = ("restart", "engine hit rate", "turns on the rank holding their history")
    if args.markdown:
        print("\n| " + " | ".join(head) + " |\n|---|---|---|")
    for saved in (False, True):
        name = "with --route-index-file" if saved else "without (replay buffer only)"
        hit = ", ".join(f"{h:.2f}" for h, _ in rows[saved])
        follow = ", ".join(f"{f:.2f}" for _, f in rows[saved])
        print(f"| {name} | {hit} | {follow} |" if args.markdown else f"{name}: {hit}; {follow}")


if __name__ == "__main__":
    os.environ.setdefault("RANKGATE_LOG_LEVEL", "warning")
    main()
