"""Gateway overhead against peers: CPU per request at saturation, CPU per token paced.

Rankgate (``rankgate serve``, kv policy), vllm-router 0.1.17 (gRPC mode, kv_aware) and Dynamo
1.6.1's frontend with its vLLM sidecar (kv router) each run in turn, pinned to one core
(``--gateway-cpu``), in front of one mock vLLM engine (DP=2, KV events on) that shares the
other core (``--engine-cpu``) with the load generator. The tokenizer is a Llama-sized one
(32k byte-level BPE, five added tokens; :mod:`llama_tokenizer` trains it once). Per gateway:

- CPU per request at saturation: ``h2load`` (compiled, so never the bottleneck) keeps
  ``--concurrency`` non-streaming chat requests of ``--short-tokens`` tokens in flight against
  the engine at zero latency, ``--requests`` of them;
- CPU per streamed token, paced: the engine's paced mode gives every running stream one token
  per shared ``--step-ms`` step, as a GPU's batched decode does; ``h2load`` keeps
  ``--concurrency`` streams in flight, and the cost per token is the slope of CPU per stream
  between ``--short-tokens`` and ``--long-tokens`` streams, so per-request costs cancel;
- added latency: chat requests one at a time through the gateway, p50/p99, minus the same
  prompt sent straight to the engine with unary ``Generate``.

CPU is the gateway's processes' CPU time (``/proc``, children included); core utilisation is
that over the phase's wall time (100% = the pinned core is saturated). Every stream and
answer is checked for its full token count before it is measured.

This machine's speed drifts by up to 2x within minutes, so one measurement of each gateway,
minutes apart, can put either ahead. ``--rounds`` measures the gateways in turn that many
times (the order reversed every other round, each gateway started afresh); the table shows
each figure's median over the rounds, and the Rankgate/vllm-router ratios are the median
(and range) of the per-round ratios, each from two measurements seconds apart.

    .venv/bin/python bench/peers_overhead.py --install-dynamo --peers dynamo   (once, online)
    scripts/in-netns .venv/bin/python bench/peers_overhead.py [--rounds 3] [--markdown]

A peer that cannot run here is listed with the reason instead of numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import jinja2
import llama_tokenizer
import peers
from tokenizers import Tokenizer

from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a short poem about data-parallel routing."},
]
PEERS = ("rankgate", "vllm-router", "dynamo")
H2LOAD = shutil.which("h2load")


class LoadFailed(RuntimeError):
    """A load run in which the gateway answered some requests with an error (or h2load could
    not finish); ``statuses`` is h2load's status-code line, when it printed one."""

    def __init__(self, gateway: str, output: str) -> None:
        super().__init__(f"h2load against {gateway} failed:\n{output}")
        line = re.search(r"status codes: .*", output)
        self.statuses = line.group(0) if line else "no status codes"


@dataclass
class Load:
    """One h2load run, the gateway CPU it cost, and the engine's plus h2load's beside it."""

    requests: int
    cpu: float
    wall: float
    load_side_cpu: float

    @property
    def per_request(self) -> float:
        return self.cpu / self.requests

    @property
    def utilisation(self) -> float:
        return self.cpu / self.wall

    @property
    def load_side_utilisation(self) -> float:
        return self.load_side_cpu / self.wall


@dataclass
class Result:
    name: str
    skipped: str = ""
    saturated: Load | None = None
    short: Load | None = None
    long: Load | None = None
    tokens: tuple[int, int] = (0, 0)
    latencies: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)

    @property
    def cpu_per_token(self) -> float:
        assert self.short is not None
        assert self.long is not None
        short, long = self.tokens
        return (self.long.per_request - self.short.per_request) / (long - short)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def body(model: str, stream: bool, max_tokens: int) -> dict[str, object]:
    request: dict[str, object] = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        request["stream_options"] = {"include_usage": True}
    return request


def h2load(
    gateway: peers.Gateway,
    engine: peers.Engine,
    request: dict[str, object],
    n: int,
    concurrency: int,
    cpus: str,
    work: Path,
) -> Load:
    """``n`` POSTs of ``request`` at ``concurrency`` over HTTP/1.1, all of them 2xx."""
    if H2LOAD is None:
        raise SystemExit("h2load is needed: apt-get install nghttp2-client")
    payload = work / "body.json"
    payload.write_text(json.dumps(request))
    headers = ["-H", "content-type: application/json"]
    for name, value in gateway.headers.items():
        headers += ["-H", f"{name}: {value}"]
    argv = [
        "taskset", "-c", cpus, H2LOAD, "--h1", "-n", str(n), "-c", str(concurrency),
        "-T", "60", "-d", str(payload), *headers, gateway.url + "/v1/chat/completions",
    ]  # fmt: skip
    engine0, client0 = engine.cpu_seconds(), children_cpu()
    cpu0, wall0 = gateway.cpu_seconds(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    cpu1, wall1 = gateway.cpu_seconds(), time.perf_counter()
    load_side = engine.cpu_seconds() - engine0 + children_cpu() - client0
    succeeded = re.search(r"requests: .* (\d+) succeeded", done.stdout)
    ok = re.search(r"status codes: (\d+) 2xx", done.stdout)
    if done.returncode != 0 or not succeeded or not ok or int(ok.group(1)) != n:
        raise LoadFailed(gateway.name, done.stdout + done.stderr)
    return Load(n, cpu1 - cpu0, wall1 - wall0, load_side)


def children_cpu() -> float:
    """CPU of this process's waited-for children: h2load's, once its run has ended."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def check(gateway: peers.Gateway, model: str, stream: bool, max_tokens: int) -> None:
    """One request, read fully: the gateway must produce all ``max_tokens`` tokens."""
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, headers=gateway.headers) as c:
        request = body(model, stream, max_tokens)
        if not stream:
            reply = await c.post("/v1/chat/completions", json=request)
            reply.raise_for_status()
            got = reply.json()["usage"]["completion_tokens"]
        else:
            got, chunks = 0, 0
            async with c.stream("POST", "/v1/chat/completions", json=request) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        got = event["usage"]["completion_tokens"]
                    if any(ch.get("delta", {}).get("content") for ch in event["choices"]):
                        chunks += 1
            if chunks == 0:
                raise RuntimeError(f"{gateway.name} streamed no content")
    if got != max_tokens:
        raise RuntimeError(f"{gateway.name} produced {got} tokens, not {max_tokens}")


async def serial_latencies(gateway: peers.Gateway, model: str, n: int, tokens: int) -> list[float]:
    latencies: list[float] = []
    request = body(model, False, tokens)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, headers=gateway.headers) as c:
        for _ in range(n):
            start = time.perf_counter()
            reply = await c.post("/v1/chat/completions", json=request)
            reply.raise_for_status()
            latencies.append(time.perf_counter() - start)
    return latencies


def prompt_ids(engine: peers.Engine) -> list[int]:
    """The ChatML prompt a gateway sends for MESSAGES, for the direct baseline."""
    config = json.loads((engine.model_dir / "tokenizer_config.json").read_text())
    text = (
        jinja2.Environment()
        .from_string(config["chat_template"])
        .render(messages=MESSAGES, add_generation_prompt=True)
    )
    tokenizer = Tokenizer.from_file(str(engine.model_dir / "tokenizer.json"))
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    return ids


async def direct_latencies(engine: peers.Engine, n: int, max_tokens: int) -> list[float]:
    ids = prompt_ids(engine)
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(engine.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        for i in range(n):
            request = inference_pb2.GenerateRequest(
                request_id=f"direct-{i}-{time.monotonic_ns()}",
                model=engine.model,
                token_ids=inference_pb2.TokenIds(ids=ids),
                temperature=0.0,
                stopping=inference_pb2.StoppingCriteria(max_new_tokens=max_tokens),
                response=inference_pb2.ResponseOptions(output_text=True),
            )
            start = time.perf_counter()
            await stub.Generate(request, timeout=30)
            latencies.append(time.perf_counter() - start)
    return latencies


def measure_saturated(
    result: Result, gateway: peers.Gateway, engine: peers.Engine, args: argparse.Namespace
) -> None:
    model, c, short, client = engine.model, args.concurrency, args.short_tokens, args.engine_cpu
    asyncio.run(check(gateway, model, False, short))
    request = body(model, False, short)
    h2load(gateway, engine, request, max(200, args.requests // 5), c, client, args.work)
    result.direct = asyncio.run(direct_latencies(engine, args.latency_requests, short))
    result.latencies = asyncio.run(serial_latencies(gateway, model, args.latency_requests, short))
    result.saturated = h2load(gateway, engine, request, args.requests, c, client, args.work)


def measure_paced(
    result: Result, gateway: peers.Gateway, engine: peers.Engine, args: argparse.Namespace
) -> None:
    model, c, client = engine.model, args.concurrency, args.engine_cpu
    short, long = args.short_tokens, args.long_tokens
    asyncio.run(check(gateway, model, True, short))
    asyncio.run(check(gateway, model, True, long))
    warm, n_long = max(c, args.streams // 4), max(c, args.streams * short // long)
    h2load(gateway, engine, body(model, True, short), warm, c, client, args.work)
    result.short = h2load(
        gateway, engine, body(model, True, short), args.streams, c, client, args.work
    )
    result.long = h2load(gateway, engine, body(model, True, long), n_long, c, client, args.work)
    result.tokens = (short, long)


def _median(rounds: list[Result], figure: Callable[[Result], float]) -> float:
    return statistics.median(figure(r) for r in rounds)


def table(results: dict[str, list[Result]], args: argparse.Namespace, markdown: bool) -> str:
    head = (
        "gateway",
        "CPU/req ms (saturated)",
        "req/s",
        "core %",
        "engine+h2load core %",
        "CPU/token us (paced)",
        "core %",
        "p50 ms",
        "p99 ms",
        "added p50 ms",
        "added p99 ms",
    )
    rows: list[tuple[str, ...]] = []
    measured: dict[str, list[Result]] = {}
    for name, rounds in results.items():
        done = [r for r in rounds if _measured(r)]
        if not done:
            skipped = next((r.skipped for r in rounds if r.skipped), "")
            rows.append((rounds[0].name, f"not run: {skipped}", *("",) * (len(head) - 2)))
            continue
        measured[name] = done

        def med(figure: Callable[[Result], float], done: list[Result] = done) -> float:
            return _median(done, figure)

        rows.append(
            (
                done[0].name,
                f"{med(lambda r: _sat(r).per_request) * 1e3:.3f}",
                f"{med(lambda r: _sat(r).requests / _sat(r).wall):.0f}",
                f"{med(lambda r: _sat(r).utilisation) * 100:.0f}",
                f"{med(lambda r: _sat(r).load_side_utilisation) * 100:.0f}",
                f"{med(lambda r: r.cpu_per_token) * 1e6:.1f}",
                f"{med(lambda r: _long(r).utilisation) * 100:.0f}",
                f"{med(lambda r: pct(r.latencies, 0.5)) * 1e3:.2f}",
                f"{med(lambda r: pct(r.latencies, 0.99)) * 1e3:.2f}",
                f"{med(lambda r: pct(r.latencies, 0.5) - pct(r.direct, 0.5)) * 1e3:.2f}",
                f"{med(lambda r: pct(r.latencies, 0.99) - pct(r.direct, 0.99)) * 1e3:.2f}",
            )
        )
    direct = [d for rounds in results.values() for r in rounds for d in r.direct]
    if direct:
        median = statistics.median(direct) * 1e3
        rows.append(("(engine direct, gRPC)", *("",) * 6, f"{median:.2f}", "", "", ""))
    lines = [
        f"Gateway overhead, mock engine DP=2, {args.tokenizer} tokenizer, gateway pinned to CPU "
        f"{args.gateway_cpu}, engine and h2load on CPU {args.engine_cpu}, concurrency "
        f"{args.concurrency}. Saturated: {args.requests} non-streaming requests of "
        f"{args.short_tokens} tokens, engine at zero latency. Paced: {args.step_ms} ms steps, "
        f"{args.streams} streams of {args.short_tokens} tokens vs. streams of "
        f"{args.long_tokens}. Latency: {args.latency_requests} sequential requests. Medians of "
        f"{args.rounds} round(s). {peers.machine()}",
        "",
    ]
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
        widths = [min(w, 44) for w in widths]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    if "rankgate" in measured and "vllm-router" in measured:
        # Paired by round, so each ratio compares two measurements seconds apart.
        pairs = [
            (a, b)
            for a, b in zip(results["rankgate"], results["vllm-router"], strict=True)
            if _measured(a) and _measured(b)
        ]
        per_request = [_sat(a).per_request / _sat(b).per_request for a, b in pairs]
        per_token = [a.cpu_per_token / b.cpu_per_token for a, b in pairs]
        lines += [
            "",
            "Rankgate vs vllm-router, median of the per-round ratios (range): CPU per request "
            f"(saturated) {_spread(per_request)}, CPU per token (paced) {_spread(per_token)}",
            "per round, request / token: "
            + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(per_request, per_token, strict=True)),
        ]
    return "\n".join(lines)


def _measured(result: Result) -> bool:
    return not result.skipped and result.saturated is not None and result.long is not None


def _sat(result: Result) -> Load:
    assert result.saturated is not None
    return result.saturated


def _long(result: Result) -> Load:
    assert result.long is not None
    return result.long


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def start_gateway(
    name: str, stack: ExitStack, engine: peers.Engine, work: Path, cpus: str
) -> peers.Gateway:
    if name == "rankgate":
        return peers.start_rankgate(stack, engine, "kv", cpus=cpus)
    if name == "vllm-router":
        return peers.start_vllm_router(stack, engine, "kv_aware", cpus)
    return peers.start_dynamo(stack, engine, work, "kv", cpus)


def run(args: argparse.Namespace) -> dict[str, list[Result]]:
    """Each gateway's results, one per round."""
    results = {name: [Result(name) for _ in range(args.rounds)] for name in args.peers}
    tokenizer = peers.TINY_TOKENIZER if args.tokenizer == "tiny" else llama_tokenizer.ensure()
    modes: list[tuple[float, Callable[..., None]]] = [
        (0.0, measure_saturated),
        (args.step_ms / 1e3, measure_paced),
    ]
    unavailable: dict[str, str] = {}
    for pace, measure in modes:
        with ExitStack() as stack:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rankgate-peers-")))
            args.work = work
            engine = peers.start_mock_engine(
                stack,
                work,
                dp_size=2,
                tokenizer=tokenizer,
                paced_step_seconds=pace,
                cpus=args.engine_cpu,
            )
            for k in range(args.rounds):
                order = list(args.peers) if k % 2 == 0 else list(reversed(args.peers))
                for name in order:
                    result = results[name][k]
                    if name in unavailable:
                        result.skipped = unavailable[name]
                        continue
                    # One gateway at a time: they would otherwise share the pinned core.
                    with ExitStack() as own:
                        try:
                            gateway = start_gateway(name, own, engine, work, args.gateway_cpu)
                        except peers.Unavailable as exc:
                            result.skipped = unavailable[name] = str(exc)
                            print(f"{name}: not run: {exc}", flush=True)
                            continue
                        result.name = gateway.name
                        measure(result, gateway, engine, args)
                        print(f"{result.name}: {measure.__name__} round {k + 1} done", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="saturated requests")
    parser.add_argument("--streams", type=int, default=1000, help="paced short streams")
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=2.0, help="paced decode step")
    parser.add_argument("--gateway-cpu", default="1", help="taskset list for the gateway")
    parser.add_argument("--engine-cpu", default="0", help="taskset list: engine and h2load")
    parser.add_argument("--tokenizer", choices=("llama-32k", "tiny"), default="llama-32k")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each gateway")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--install-dynamo", action="store_true", help="create Dynamo's venv first if missing"
    )
    args = parser.parse_args()
    if args.install_dynamo and "dynamo" in args.peers:
        peers.install_dynamo()
    results = run(args)
    print()
    print(table(results, args, args.markdown))


if __name__ == "__main__":
    main()
