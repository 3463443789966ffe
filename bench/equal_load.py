"""Gateway CPU at equal load: Rankgate and vllm-router offered the same fixed request rates.

At saturation the gateway that is not saturated spends more CPU per request (fewer requests
per wake-up), so a comparison where one runs its core at 97% and the other at 65% flatters the
busier one. Here both are offered the same fixed rates: fractions (``--fractions``) of
vllm-router's own saturation rate, measured first in the same run. Both gateways are pinned
to ``--gateway-cpu`` and take turns at each rate, in front of one engine (DP=2) that shares
``--engine-cpu`` with the load generator (``h2load --rps``: ``--clients`` connections, or
``--stream-clients`` for streams, each sending its share of the rate). Per rate and gateway:

- non-streaming chat requests of ``--short-tokens`` tokens, the engine at zero latency: the
  gateway's CPU per request, its core utilisation, and h2load's mean request time;
- paced streams (every running stream gets one token per ``--step-ms`` step): the same rate of
  ``--short-tokens`` and of ``--long-tokens`` streams, and the CPU per token is the slope
  between the two, so per-request costs cancel.

``h2load``'s connections send in step (each on its own timer, all started together), so the
requests come in bursts of one per connection and a gateway serves a burst in one wake-up.
``--arrivals poisson`` sends the non-streaming requests as independent clients would instead:
a Poisson process over as many keep-alive connections (``bench/open_loop.mjs``, Node), and
``--unique`` gives every one a question of its own, so whole-prompt caches stop helping and the
engine stores (and announces) new KV blocks for every request. Streams stay on ``h2load``:
their per-token figure is a slope between two lengths at the same arrivals.

The engine (``--engine``) is our mock (KV events on), or a fake in another runtime
(``bench/node_engine.mjs``: Node's HTTP/2 server, no KV events) so the figures do not rest on
one engine's costs and timing alone.

The machine drifts, within minutes, by as much as a change is worth. So both gateways stay up
through a round (a fresh pair each round) and take ``--turns`` turns each at every rate,
alternating, the order flipping every turn and round: a Rankgate run and the vllm-router run
beside it are seconds apart. The table gives each figure's median over all turns, and the
Rankgate / vllm-router ratio is taken within each pair of turns: the median of those ratios,
with their range in brackets. In front of the mock the idle gateway still takes the KV events
the busy one's traffic makes, on the same core but on its own account.
Saturation figures come from ``bench/peers_overhead.py``.

The interpreter is part of the figure: the image runs the official CPython image's build,
compiled with profile-guided and link-time optimization, on which the gateway spends about
6% less CPU a request than on a default ``pyenv`` build (``bench/tree_ab.py TREE@PYTHON``).
``--gateway-python`` serves Rankgate under another interpreter (a venv of Debian's
``/usr/bin/python3.11``, built the same way, stands in for the image's), and the title names
the one that ran.

    scripts/in-netns .venv/bin/python bench/equal_load.py [--rounds 3] [--markdown] \\
        [--gateway-python /tmp/pgo/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import llama_tokenizer
import peers
import peers_overhead as po

GATEWAYS = ("rankgate", "vllm-router")


@dataclass
class Fixed:
    """One fixed-rate run: the gateway's CPU over it and the client's mean request time."""

    requests: int
    cpu: float
    wall: float
    mean_ms: float

    @property
    def per_request(self) -> float:
        return self.cpu / self.requests

    @property
    def utilisation(self) -> float:
        return self.cpu / self.wall


OPEN_LOOP = Path(__file__).with_name("open_loop.mjs")


def fixed_rate(
    gateway: peers.Gateway,
    request: dict[str, object],
    rate: float,
    args: argparse.Namespace,
) -> Fixed:
    """``rate`` requests a second of ``request`` for ``--seconds``, every one 2xx."""
    if args.arrivals == "poisson" and not request.get("stream"):
        return open_loop(gateway, request, rate, args)
    clients = args.stream_clients if request.get("stream") else args.clients
    n = max(clients, round(rate * args.seconds))
    payload = args.work / "fixed.json"
    payload.write_text(json.dumps(request))
    headers = ["-H", "content-type: application/json"]
    for name, value in gateway.headers.items():
        headers += ["-H", f"{name}: {value}"]
    argv = [
        "taskset", "-c", args.engine_cpu, str(po.H2LOAD), "--h1", "-n", str(n),
        "-c", str(clients), "--rps", f"{rate / clients:.3f}", "-T", "60",
        "-d", str(payload), *headers, gateway.url + "/v1/chat/completions",
    ]  # fmt: skip
    cpu0, wall0 = gateway.cpu_seconds(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    cpu1, wall1 = gateway.cpu_seconds(), time.perf_counter()
    ok = re.search(r"status codes: (\d+) 2xx", done.stdout)
    timing = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", done.stdout)
    if done.returncode != 0 or not ok or int(ok.group(1)) != n or not timing:
        raise po.LoadFailed(gateway.name, done.stdout + done.stderr)
    return Fixed(n, cpu1 - cpu0, wall1 - wall0, _ms(timing.group(1)))


def open_loop(
    gateway: peers.Gateway, request: dict[str, object], rate: float, args: argparse.Namespace
) -> Fixed:
    """:func:`fixed_rate` with Poisson arrivals (``bench/open_loop.mjs``)."""
    payload = args.work / "open.json"
    payload.write_text(json.dumps(request))
    argv = [
        "taskset", "-c", args.engine_cpu, "node", str(OPEN_LOOP), "--url",
        gateway.url + "/v1/chat/completions", "--body", str(payload), "--rate", f"{rate:.3f}",
        "--seconds", str(args.seconds), "--clients", str(args.clients),
    ]  # fmt: skip
    if args.unique:
        argv.append("--unique")
    for name, value in gateway.headers.items():
        argv += ["--header", f"{name}: {value}"]
    cpu0, wall0 = gateway.cpu_seconds(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    cpu1, wall1 = gateway.cpu_seconds(), time.perf_counter()
    try:
        figures = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        figures = {}
    if done.returncode != 0 or figures.get("ok") != figures.get("requests"):
        raise RuntimeError(f"open loop against {gateway.name} failed:\n{done.stdout}{done.stderr}")
    return Fixed(int(figures["requests"]), cpu1 - cpu0, wall1 - wall0, float(figures["mean_ms"]))


def parse_with_arrivals(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments with ``--arrivals`` and ``--unique``, which :func:`fixed_rate`
    reads, added and checked."""
    parser.add_argument(
        "--arrivals",
        choices=("h2load", "poisson"),
        default="h2load",
        help="non-streaming requests from h2load --rps (in step), or as a Poisson process "
        "(bench/open_loop.mjs)",
    )
    parser.add_argument(
        "--unique",
        action="store_true",
        help="with --arrivals poisson: a question of its own in every request",
    )
    args = parser.parse_args()
    if args.unique and args.arrivals != "poisson":
        parser.error("--unique needs --arrivals poisson (h2load sends one body)")
    return args


def _ms(text: str) -> float:
    for unit, scale in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


SATURATION_TRIES = 3


def saturation_rate(
    engine: peers.Engine, request: dict[str, object], args: argparse.Namespace
) -> float:
    """vllm-router's requests per second with as many requests always in flight as the
    fixed-rate runs have clients.

    Saturated with paced streams in front of the Node engine, vllm-router sometimes fails to
    open its gRPC streams (its log: ``GenerateStream failed ... h2 protocol error: http2
    error``, the engine seeing no error), and its circuit breaker then fails most of the run.
    Such a run is said and taken again with a fresh vllm-router, up to three times in all."""
    clients = args.stream_clients if request.get("stream") else args.clients
    for _ in range(SATURATION_TRIES - 1):
        try:
            return _saturate(engine, request, clients, args)
        except po.LoadFailed as failure:
            print(
                f"vllm-router failed its saturation run ({failure.statuses}); "
                "again with a fresh one",
                flush=True,
            )
    return _saturate(engine, request, clients, args)


def _saturate(
    engine: peers.Engine, request: dict[str, object], clients: int, args: argparse.Namespace
) -> float:
    with ExitStack() as own:
        router = peers.start_vllm_router(own, engine, "kv_aware", args.gateway_cpu)
        po.h2load(router, engine, request, 400, clients, args.engine_cpu, args.work)
        load = po.h2load(router, engine, request, 3000, clients, args.engine_cpu, args.work)
    return load.requests / load.wall


def start(
    name: str, stack: ExitStack, engine: peers.Engine, args: argparse.Namespace
) -> peers.Gateway:
    if name == "rankgate":
        return peers.start_rankgate(
            stack, engine, "kv", cpus=args.gateway_cpu, python=args.gateway_python
        )
    return peers.start_vllm_router(stack, engine, "kv_aware", args.gateway_cpu)


def measure(args: argparse.Namespace, paced: bool) -> dict[tuple[str, float, str], list[Fixed]]:
    """(gateway, fraction, "short"|"long") -> one Fixed per round."""
    out: dict[tuple[str, float, str], list[Fixed]] = {}
    tokenizer = peers.TINY_TOKENIZER if args.tokenizer == "tiny" else llama_tokenizer.ensure()
    with ExitStack() as stack:
        args.work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rankgate-eq-")))
        starter = peers.start_node_engine if args.engine == "node" else peers.start_mock_engine
        engine = starter(
            stack,
            args.work,
            dp_size=2,
            tokenizer=tokenizer,
            paced_step_seconds=args.step_ms / 1e3 if paced else 0.0,
            cpus=args.engine_cpu,
        )
        lengths = ("short", "long") if paced else ("short",)
        tokens = {"short": args.short_tokens, "long": args.long_tokens}
        calibrate = po.body(engine.model, paced, tokens[lengths[-1]])
        saturated = saturation_rate(engine, calibrate, args)
        print(f"{'paced' if paced else 'non-streaming'}: vllm-router saturates at "
              f"{saturated:.0f} req/s", flush=True)  # fmt: skip
        for k in range(args.rounds):
            with ExitStack() as own:
                # Both gateways live through the round, on the same core, and take turns:
                # the idle one's background work is about 1% of the core, and runs of the
                # two at one rate are seconds apart, not minutes.
                gateways = {name: start(name, own, engine, args) for name in GATEWAYS}
                requests: dict[str, dict[str, object]] = {}
                for length in lengths:
                    requests[length] = po.body(engine.model, paced, tokens[length])
                    for gateway in gateways.values():
                        asyncio.run(po.check(gateway, engine.model, paced, tokens[length]))
                        fixed_rate(gateway, requests[length], saturated * 0.25, args)  # warm-up
                for fraction, turn in itertools.product(args.fractions, range(args.turns)):
                    rate = saturated * fraction
                    order = GATEWAYS if (k + turn) % 2 == 0 else GATEWAYS[::-1]
                    # A gateway's short and long streams back to back: the per-token figure is
                    # their difference, which drift between them would swamp.
                    for name, length in itertools.product(order, lengths):
                        run = fixed_rate(gateways[name], requests[length], rate, args)
                        out.setdefault((name, fraction, length), []).append(run)
            print(f"round {k + 1} done", flush=True)
    return out


def report(
    plain: dict[tuple[str, float, str], list[Fixed]],
    paced: dict[tuple[str, float, str], list[Fixed]],
    args: argparse.Namespace,
) -> None:
    def med(runs: list[Fixed], figure: str) -> float:
        return float(statistics.median(float(getattr(run, figure)) for run in runs))

    def slopes(name: str, fraction: float) -> list[float]:
        """Each turn's CPU per streamed token: its long streams' CPU less its short ones'."""
        pairs = zip(paced[(name, fraction, "short")], paced[(name, fraction, "long")], strict=True)
        span = args.long_tokens - args.short_tokens
        return [(long.per_request - short.per_request) / span for short, long in pairs]

    def per_token(name: str, fraction: float) -> float:
        return float(statistics.median(slopes(name, fraction)))

    def paired(ours: list[float], theirs: list[float]) -> str:
        """The median of the ratios of turns taken side by side, and their range."""
        ratios = [a / b for a, b in zip(ours, theirs, strict=True) if b > 0]
        if not ratios:
            return "n/a"
        median = statistics.median(ratios)
        return f"{median:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    rows = []
    for fraction in args.fractions:
        for name in GATEWAYS:
            runs = plain[(name, fraction, "short")]
            rows.append(
                [
                    f"{fraction:.0%}",
                    name,
                    f"{med(runs, 'per_request') * 1e3:.3f}",
                    f"{med(runs, 'utilisation'):.0%}",
                    f"{med(runs, 'mean_ms'):.2f}",
                    f"{per_token(name, fraction) * 1e6:.1f}",
                    f"{med(paced[(name, fraction, 'long')], 'utilisation'):.0%}",
                ]
            )
        ours, theirs = GATEWAYS
        requests = paired(
            [run.per_request for run in plain[(ours, fraction, "short")]],
            [run.per_request for run in plain[(theirs, fraction, "short")]],
        )
        tokens = paired(slopes(ours, fraction), slopes(theirs, fraction))
        rows.append(["", "ratio", requests, "", "", tokens, ""])
    head = (
        "rate (of vllm-router's saturation)", "gateway", "CPU ms / request", "core",
        "mean request ms", "CPU us / streamed token", "core (long streams)",
    )  # fmt: skip
    arrivals = "Poisson arrivals" if args.arrivals == "poisson" else "h2load --rps"
    prompts = ", unique prompts" if args.unique else ""
    title = (
        f"equal load, {args.rounds} rounds of {args.turns} turns, {args.engine} engine, "
        f"{arrivals}{prompts}, Rankgate on {interpreter(args.gateway_python)}"
    )
    print(peers.table(head, rows, title, args.markdown))


def interpreter(python: str) -> str:
    """Which CPython serves the gateway: its build decides a good part of the CPU figures
    (PGO and LTO, as the image's has, against a plain build)."""
    probe = [python, "-c", "import sys; print(sys.version.split()[0], sys._base_executable)"]
    done = subprocess.run(probe, capture_output=True, text=True, check=True)
    version, executable = done.stdout.split(maxsplit=1)
    return f"CPython {version} ({executable.strip()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.8])
    parser.add_argument("--seconds", type=float, default=10.0, help="per fixed-rate run")
    parser.add_argument("--clients", type=int, default=16, help="connections, non-streaming")
    parser.add_argument(
        "--stream-clients",
        type=int,
        default=64,
        help="connections for paced streams (a long stream lasts long-tokens x step-ms)",
    )
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=2.0, help="paced decode step")
    parser.add_argument("--gateway-cpu", default="1", help="taskset list for the gateway")
    parser.add_argument("--engine-cpu", default="0", help="taskset list: engine and h2load")
    parser.add_argument("--tokenizer", choices=("llama-32k", "tiny"), default="llama-32k")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--turns",
        type=int,
        default=3,
        help="turns per gateway at each rate within a round, alternating",
    )
    parser.add_argument(
        "--engine",
        choices=("mock", "node"),
        default="mock",
        help="our mock (KV events on) or the Node fake (bench/node_engine.mjs, no KV events)",
    )
    parser.add_argument(
        "--gateway-python",
        default=sys.executable,
        help="the interpreter Rankgate serves under (with its dependencies installed); "
        "the image's CPython is built with PGO and LTO, a pyenv default build is not",
    )
    parser.add_argument("--markdown", action="store_true")
    args = parse_with_arrivals(parser)
    plain = measure(args, paced=False)
    paced = measure(args, paced=True)
    print()
    report(plain, paced, args)


if __name__ == "__main__":
    main()
