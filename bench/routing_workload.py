"""Routing policies against the mock engine (DP=4, GPU-like timing): prefix hit rate and TTFT.

Two workloads, each run once per policy on a fresh engine and a fresh gateway (or, with
``--via sidecar``, straight into the Sidecar facade):

* ``shared``: conversations that share a system prompt, several turns each; every turn's prompt
  is the previous prompt, the model's answer and a new user message (token ids end to end).
* ``unique``: one-turn requests with nothing in common, arriving at a steady rate.

The hit rate is the engine's own count (cached prompt tokens / prompt tokens over all ranks);
TTFT is measured at the client, from sending the request to the first token.

    PYTHONPATH=. .venv/bin/python bench/routing_workload.py [--speed 0.1] [--via gateway|sidecar]
        [--workload shared unique] [--policy kv load round_robin engine] [--together]

At ``--speed 0.1`` (the GPU-like model ten times slower) simulated prefill and decode time,
not this machine's CPU, dominates TTFT; faster speeds measure the gateway's CPU as well.
Policies run one after another unless ``--together``, which runs them side by side so that
background load on the machine hits them alike.

The workloads live in ``tests/routing/workload.py``; ``tests/routing/test_workload.py`` runs
the same functions and asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio

from rankgate.sidecar.routing.config import POLICIES
from tests.routing.workload import NoReuse, PolicyResult, SharedPrefix, Workload, run_policy, table


async def _main(args: argparse.Namespace) -> None:
    results: list[PolicyResult] = []
    workloads: dict[str, Workload] = {"shared": SharedPrefix(), "unique": NoReuse()}
    for name in args.workload:
        if args.together:
            batch = await asyncio.gather(
                *(
                    run_policy(policy, workloads[name], args.speed, via=args.via)
                    for policy in args.policy
                )
            )
            results.extend(batch)
            continue
        for policy in args.policy:
            results.append(await run_policy(policy, workloads[name], args.speed, via=args.via))
            print(table(results[-1:]).splitlines()[1], flush=True)
    print()
    print(table(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--speed",
        type=float,
        default=0.1,
        help="mock timing (1.0 = GPU-like, 0.1 = ten times slower)",
    )
    parser.add_argument("--workload", nargs="+", default=["shared", "unique"])
    parser.add_argument("--policy", nargs="+", default=list(POLICIES))
    parser.add_argument("--together", action="store_true", help="run the policies concurrently")
    parser.add_argument(
        "--via", choices=("gateway", "sidecar"), default="gateway", help="HTTP or the facade"
    )
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
