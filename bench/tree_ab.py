"""One change, measured: the gateway's CPU per request served from two or more source trees.

A change to the request path is a few microseconds of a quarter millisecond, less than one
equal-load run's noise. This serves the same fixed rate of non-streaming chat requests from
each tree in turn (``rankgate serve`` started in that tree, in front of one mock engine,
DP=2, KV events on), the order flipping every round, and prints for each run the CPU per
request, split into user and system time and by thread, and the page faults per request;
then each tree's median. ``router`` in place of a tree runs vllm-router ``kv_aware`` at the
same rate, for scale, and ``floor`` a bare ASGI app under the gateway's own HTTP server
(:mod:`http_floor`), what a request costs before the gateway does anything (``floor:SERVER``
the same answer behind another HTTP server). ``TREE+ARGS``
serves ``TREE`` with extra ``rankgate serve`` arguments, comma-separated
(``.+--policy,round_robin``): one feature switched off against the same tree, and
``TREE@PYTHON`` serves it under another interpreter with the dependencies installed (one
Python against another; a compiled tree holds modules built for one of them).

Make the trees with ``git worktree add /tmp/before REV`` (and a compiled one with
``RANKGATE_COMPILE=1 python setup.py build_ext --inplace`` inside it)::

    scripts/in-netns .venv/bin/python bench/tree_ab.py --rate 1500 --rounds 3 . /tmp/before
    scripts/in-netns .venv/bin/python bench/tree_ab.py floor . .+--route-regret-keys,0 router
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import equal_load
import llama_tokenizer
import peers
from peers_overhead import body

from tests.support.ports import free_port

TICKS = peers.TICKS


@dataclass(frozen=True)
class Usage:
    """A process tree's counters from /proc: user and system ticks by thread, and faults."""

    user: dict[str, int]
    system: dict[str, int]
    faults: int

    @classmethod
    def of(cls, gateway: peers.Gateway) -> Usage:
        user: dict[str, int] = {}
        system: dict[str, int] = {}
        faults = 0
        for pid in peers._tree(gateway.pids):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                faults += int(fields[7]) + int(fields[9])
                for task in Path(f"/proc/{pid}/task").iterdir():
                    raw = (task / "stat").read_text()
                    name = f"{raw.split('(', 1)[1].rsplit(')', 1)[0]}/{task.name}"
                    fields = raw.rsplit(")", 1)[1].split()
                    user[name] = int(fields[11])
                    system[name] = int(fields[12])
            except (FileNotFoundError, ProcessLookupError):
                continue
        return cls(user, system, faults)


@dataclass(frozen=True)
class Run:
    requests: int
    user_ms: float
    system_ms: float
    faults: float
    threads: dict[str, float]

    @property
    def cpu_ms(self) -> float:
        return self.user_ms + self.system_ms


def measure(gateway: peers.Gateway, request: dict[str, object], args: argparse.Namespace) -> Run:
    before = Usage.of(gateway)
    fixed = equal_load.fixed_rate(gateway, request, args.rate, args)
    after = Usage.of(gateway)
    n = fixed.requests

    def per_request(ticks: int) -> float:
        return ticks / TICKS / n * 1e3

    threads = {
        name: per_request(after.user[name] + after.system[name] - user - before.system[name])
        for name, user in before.user.items()
        if name in after.user
    }
    return Run(
        n,
        per_request(sum(after.user.values()) - sum(before.user.values())),
        per_request(sum(after.system.values()) - sum(before.system.values())),
        (after.faults - before.faults) / n,
        {name: ms for name, ms in threads.items() if ms > 0},
    )


def start(stack: ExitStack, engine: peers.Engine, spec: str, cpus: str) -> peers.Gateway:
    """The gateway ``spec`` names: ``router``, ``floor[:SERVER]``, a tree, or ``TREE+ARGS``."""
    if spec == "router":
        return peers.start_vllm_router(stack, engine, "kv_aware", cpus)
    if spec == "floor" or spec.startswith("floor:"):
        server = spec.partition(":")[2] or "uvicorn"
        port = free_port()
        script = Path(__file__).with_name("http_floor.py")
        argv = [sys.executable, str(script), str(port), "--server", server]
        proc = peers.launch(stack, argv, f"http-floor-{server}", cpus=cpus)
        url = f"http://127.0.0.1:{port}"
        peers.wait_http(url, [proc], "/ready")
        return peers.Gateway(f"http floor ({server})", url, [proc.pid])
    tree, _, extra = spec.partition("+")
    tree, _, python = tree.partition("@")
    return peers.start_rankgate(
        stack,
        engine,
        "kv",
        extra.split(",") if extra else (),
        cpus=cpus,
        tree=Path(tree).resolve(),
        python=python or sys.executable,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "trees",
        nargs="+",
        help="source trees (TREE@PYTHON picks the interpreter, TREE+ARG,ARG adds serve arguments), "
        "router, floor[:SERVER]",
    )
    parser.add_argument("--rate", type=float, default=1500.0, help="requests a second")
    parser.add_argument("--seconds", type=float, default=8.0, help="per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--tokenizer", choices=("llama-32k", "tiny"), default="llama-32k")
    parser.add_argument("--gateway-cpu", default="1")
    parser.add_argument("--engine-cpu", default="0")
    parser.add_argument(
        "--engine",
        choices=("mock", "node"),
        default="mock",
        help="our mock (KV events on) or the Node fake (bench/node_engine.mjs, no KV events)",
    )
    args = equal_load.parse_with_arrivals(parser)
    args.stream_clients = args.clients
    results: dict[str, list[Run]] = {tree: [] for tree in args.trees}
    with ExitStack() as stack:
        args.work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rankgate-ab-")))
        tokenizer = peers.TINY_TOKENIZER if args.tokenizer == "tiny" else llama_tokenizer.ensure()
        starter = peers.start_node_engine if args.engine == "node" else peers.start_mock_engine
        engine = starter(stack, args.work, dp_size=2, tokenizer=tokenizer, cpus=args.engine_cpu)
        request = body(engine.model, False, args.short_tokens)
        for round_ in range(args.rounds):
            for tree in args.trees if round_ % 2 == 0 else args.trees[::-1]:
                with ExitStack() as own:
                    gateway = start(own, engine, tree, args.gateway_cpu)
                    gateway.settle()
                    measure(gateway, request, args)  # warm-up
                    run = measure(gateway, request, args)
                results[tree].append(run)
                busiest = ", ".join(
                    f"{name} {ms:.4f}"
                    for name, ms in sorted(run.threads.items(), key=lambda kv: -kv[1])[:3]
                )
                print(
                    f"round {round_} {tree}: {run.cpu_ms:.4f} ms a request (user "
                    f"{run.user_ms:.4f}, system {run.system_ms:.4f}), {run.faults:.3f} faults; "
                    f"threads: {busiest}",
                    flush=True,
                )
    print(f"\n{args.rate:.0f} requests/s, {args.rounds} rounds, median ms a request:")
    for tree, runs in results.items():
        cpu = statistics.median(run.cpu_ms for run in runs)
        user = statistics.median(run.user_ms for run in runs)
        each = " ".join(f"{run.cpu_ms:.4f}" for run in runs)
        print(f"  {tree}: {cpu:.4f} (user {user:.4f}) [{each}]")


if __name__ == "__main__":
    main()
