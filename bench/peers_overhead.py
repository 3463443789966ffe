"""Gateway overhead against peers: CPU per request, CPU per streamed token, added latency.

One mock vLLM engine (zero latency, DP=2, KV events on) serves every gateway in turn:
Rankgate (``rankgate serve``, kv policy), vllm-router 0.1.17 (gRPC mode, kv_aware) and
Dynamo 1.6.1's frontend with its vLLM sidecar (kv router). For each gateway, from this
process as the client:

- added latency: chat requests one at a time through the gateway, p50/p99, minus the same
  prompt sent straight to the engine with unary ``Generate`` (measured just before);
- CPU per request: the gateway's processes' CPU time (``/proc``, children included) over
  ``--requests`` non-streaming chat requests at ``--concurrency``;
- CPU per streamed token: the slope of CPU per request between streams of
  ``--short-tokens`` and ``--long-tokens`` tokens, so per-request costs cancel out.

    scripts/in-netns .venv/bin/python bench/peers_overhead.py [--requests 2000] [--markdown]

A peer that cannot run here is listed with the reason instead of numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import jinja2
import peers
from tokenizers import Tokenizer

from sidecar.proto.vllm import inference_pb2, inference_pb2_grpc

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a short poem about data-parallel routing."},
]
PEERS = ("rankgate", "vllm-router", "dynamo")


@dataclass
class Result:
    name: str
    skipped: str = ""
    cpu_per_request: float = 0.0
    cpu_per_token: float = 0.0
    requests_per_second: float = 0.0
    latencies: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Phase:
    requests: int
    tokens: int
    cpu: float
    wall: float
    latencies: list[float]


async def drive(
    gateway: peers.Gateway,
    model: str,
    n: int,
    concurrency: int,
    stream: bool,
    max_tokens: int,
) -> Phase:
    body: dict[str, object] = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    latencies: list[float] = []
    tokens = 0
    todo = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=gateway.url, timeout=60, limits=limits, headers=gateway.headers
    ) as client:

        async def worker() -> None:
            nonlocal tokens
            for _ in todo:
                start = time.perf_counter()
                if stream:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        chunks = 0
                        usage = 0
                        async for line in r.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            event = json.loads(line[6:])
                            if event.get("usage"):
                                usage = event["usage"]["completion_tokens"]
                            if any(c.get("delta", {}).get("content") for c in event["choices"]):
                                chunks += 1
                        tokens += usage or chunks
                else:
                    r = await client.post("/v1/chat/completions", json=body)
                    r.raise_for_status()
                    tokens += r.json()["usage"]["completion_tokens"]
                latencies.append(time.perf_counter() - start)

        cpu0, wall0 = gateway.cpu_seconds(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu1, wall1 = gateway.cpu_seconds(), time.perf_counter()
    return Phase(n, tokens, cpu1 - cpu0, wall1 - wall0, latencies)


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


async def measure(gateway: peers.Gateway, engine: peers.Engine, args: argparse.Namespace) -> Result:
    model, c, n = engine.model, args.concurrency, args.requests
    short, long = args.short_tokens, args.long_tokens
    await drive(gateway, model, max(50, n // 10), c, False, short)
    await drive(gateway, model, max(25, n // 20), c, True, short)
    result = Result(gateway.name)
    result.direct = await direct_latencies(engine, args.latency_requests, short)
    serial = await drive(gateway, model, args.latency_requests, 1, False, short)
    result.latencies = serial.latencies
    plain = await drive(gateway, model, n, c, False, short)
    s_short = await drive(gateway, model, n, c, True, short)
    s_long = await drive(gateway, model, max(1, n // 2), c, True, long)
    result.cpu_per_request = plain.cpu / plain.requests
    result.requests_per_second = plain.requests / plain.wall
    per_short = s_short.cpu / s_short.requests
    per_long = s_long.cpu / s_long.requests
    tokens_short = s_short.tokens / s_short.requests
    tokens_long = s_long.tokens / s_long.requests
    result.cpu_per_token = (per_long - per_short) / max(tokens_long - tokens_short, 1e-9)
    return result


def table(results: list[Result], args: argparse.Namespace, markdown: bool) -> str:
    head = (
        "gateway",
        "CPU/req ms",
        "CPU/token us",
        "req/s",
        "p50 ms",
        "p99 ms",
        "added p50 ms",
        "added p99 ms",
    )
    rows: list[tuple[str, ...]] = []
    for r in results:
        if r.skipped:
            rows.append((r.name, f"not run: {r.skipped}", *("",) * 6))
            continue
        rows.append(
            (
                r.name,
                f"{r.cpu_per_request * 1e3:.3f}",
                f"{r.cpu_per_token * 1e6:.1f}",
                f"{r.requests_per_second:.0f}",
                f"{pct(r.latencies, 0.5) * 1e3:.2f}",
                f"{pct(r.latencies, 0.99) * 1e3:.2f}",
                f"{(pct(r.latencies, 0.5) - pct(r.direct, 0.5)) * 1e3:.2f}",
                f"{(pct(r.latencies, 0.99) - pct(r.direct, 0.99)) * 1e3:.2f}",
            )
        )
    direct = [d for r in results for d in r.direct]
    if direct:
        median = statistics.median(direct) * 1e3
        rows.append(("(engine direct, gRPC)", "", "", "", f"{median:.2f}", "", "", ""))
    lines = [
        f"Gateway overhead, mock engine at zero latency (DP=2), {args.requests} requests per "
        f"phase at concurrency {args.concurrency}, {args.short_tokens}/{args.long_tokens} "
        f"tokens; latency: {args.latency_requests} sequential requests. {peers.machine()}",
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
    measured = {r.name.split()[0]: r for r in results if not r.skipped}
    if "rankgate" in measured and "vllm-router" in measured:
        ratio = measured["rankgate"].cpu_per_request / measured["vllm-router"].cpu_per_request
        lines += ["", f"Rankgate CPU per request = {ratio:.2f}x vllm-router's"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    results: list[Result] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="rankgate-peers-") as tmp:
        work = Path(tmp)
        engine = peers.start_mock_engine(stack, work, dp_size=2, speed=0.0)
        starters: dict[str, Callable[[ExitStack], peers.Gateway]] = {
            "rankgate": lambda s: peers.start_rankgate(s, engine, "kv"),
            "vllm-router": lambda s: peers.start_vllm_router(s, engine, "kv_aware"),
            "dynamo": lambda s: peers.start_dynamo(s, engine, work, "kv"),
        }
        for name in args.peers:
            # One gateway at a time: they would otherwise share the two cores.
            with ExitStack() as own:
                try:
                    gateway = starters[name](own)
                except peers.Unavailable as exc:
                    results.append(Result(name, skipped=str(exc)))
                    print(f"{name}: not run: {exc}", flush=True)
                    continue
                result = asyncio.run(measure(gateway, engine, args))
                results.append(result)
                print(
                    f"{result.name}: CPU/req {result.cpu_per_request * 1e3:.3f} ms, "
                    f"CPU/token {result.cpu_per_token * 1e6:.1f} us",
                    flush=True,
                )
    print()
    print(table(results, args, args.markdown))


if __name__ == "__main__":
    main()
