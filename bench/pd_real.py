"""Disaggregated serving on a real prefill/decode pair: TTFT and end-to-end latency of the
aggregated path, plain P/D, P/D with first-token seeding and the per-request choice.

A prefill engine and a decode engine (the tiny Llama, DP=1 each, NIXL over loopback, each on
a CPU of its own) and four gateways in this process, one per configuration:

- ``aggregated``: every prompt prefilled on the decode engine (``--pd-prefill local``), i.e.
  one engine doing both phases, the baseline;
- ``pd``: every prompt prefilled on the prefill engine and transferred, no seeding;
- ``pd+seed``: the same with first-token seeding;
- ``auto``: the per-request choice (``--pd-prefill auto``) with seeding, the default.

Each request is a streamed ``/v1/completions`` call with token-id prompts (so the length is
exact) of ``--short`` or ``--long`` tokens, greedy, ``--tokens`` output tokens, one at a time
(no queueing: TTFT is service time). *Cold* prompts are new; *warm* ones were sent once
before through the same gateway (the first send is not measured). The configurations are
interleaved request by request within each round, in a shuffled order, so the machine's drift
and the engines' post-step spinning fall on all.

    flock /tmp/rankgate-vllm.lock scripts/in-netns .venv/bin/python bench/pd_real.py --markdown
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.sidecar.config import DisaggConfig
from tests.app.serving import serve_app
from tests.support.real_vllm import RealVllmPair, start_real_vllm_pair

CONFIGS: dict[str, DisaggConfig] = {
    "aggregated": DisaggConfig(prefill_mode="local"),
    "pd": DisaggConfig(prefill_mode="remote", seed_first_token=False),
    "pd+seed": DisaggConfig(prefill_mode="remote"),
    "auto": DisaggConfig(),
}


def timed(url: str, model: str, prompt: list[int], tokens: int) -> tuple[float, float]:
    """Seconds to the first streamed token and to the end of one streamed completion."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                chunk = orjson.loads(line[6:])
                if any(choice.get("text") for choice in chunk["choices"]):
                    first = time.perf_counter()
    done = time.perf_counter()
    return (first or done) - started, done - started


def measure(pair: RealVllmPair, args: argparse.Namespace) -> dict[tuple[str, str], list[Any]]:
    model = pair.decode.served_model_name
    rng = random.Random(17)
    results: dict[tuple[str, str], list[Any]] = {}
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                serve_app(
                    create_app(
                        GatewaySettings(
                            prefill_engine=pair.prefill.target,
                            decode_engine=pair.decode.target,
                            tokenizer=str(pair.decode.model_dir),
                            startup_timeout=180.0,
                            disagg=config,
                        ),
                        media=MediaPreparer(MediaConfig()),
                    )
                )
            )
            for name, config in CONFIGS.items()
        }

        def prompt(length: int) -> list[int]:
            return [rng.randrange(100, 1900) for _ in range(length)]

        for url in urls.values():  # warm-up: every path once
            timed(url, model, prompt(args.short), args.tokens)
        for _ in range(args.rounds):
            for _ in range(args.requests):
                for length, size in (("short", args.short), ("long", args.long)):
                    # In a fresh order each time: vLLM's CPU workers spin for a second after
                    # each step, which would weigh on whichever path always came next.
                    order = list(urls.items())
                    rng.shuffle(order)
                    for name, url in order:
                        cold = prompt(size)
                        results.setdefault((name, f"{length} cold"), []).append(
                            timed(url, model, cold, args.tokens)
                        )
                        warm = prompt(size)
                        timed(url, model, warm, args.tokens)
                        results.setdefault((name, f"{length} warm"), []).append(
                            timed(url, model, warm, args.tokens)
                        )
    return results


def report(results: dict[tuple[str, str], list[Any]], markdown: bool) -> None:
    cells = sorted({cell for _, cell in results}, key=lambda c: (c.split()[0] != "short", c))
    rows = []
    for cell in cells:
        base = statistics.mean(t for t, _ in results[("aggregated", cell)])
        for name in CONFIGS:
            samples = results[(name, cell)]
            ttft = [t * 1e3 for t, _ in samples]
            e2e = [e * 1e3 for _, e in samples]
            mean = statistics.mean(ttft)
            rows.append(
                (
                    cell,
                    name,
                    f"{mean:.1f}",
                    f"{statistics.median(ttft):.1f}",
                    f"{mean / (base * 1e3):.2f}x",
                    f"{statistics.mean(e2e):.1f}",
                    str(len(samples)),
                )
            )
    header = (
        "prompt",
        "config",
        "mean TTFT ms",
        "p50 TTFT ms",
        "vs aggregated",
        "mean e2e ms",
        "n",
    )
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    for row in (header, *rows):
        print("  ".join(f"{value:>14}" for value in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="per cell and round")
    parser.add_argument("--short", type=int, default=64)
    parser.add_argument("--long", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    print(
        f"tiny Llama prefill/decode pair over NIXL, prefill engine on CPU {cpus[0]}, decode "
        f"engine on CPU {cpus[-1]}; {args.short}- and {args.long}-token prompts, "
        f"{args.tokens} tokens out, {args.rounds} rounds x {args.requests} requests a cell"
    )
    with start_real_vllm_pair(
        block_size=32,
        model="llama",
        max_model_len=args.long + args.tokens + 64,
        cpus=str(cpus[0]),
        decode_cpus=str(cpus[-1]),
        # The gateway and client share the engines' cores; niced engines let them run first,
        # as they would beside a GPU.
        nice=10,
    ) as pair:
        results = measure(pair, args)
    report(results, args.markdown)


if __name__ == "__main__":
    main()
