"""Gateway latency and CPU per request as prompts grow, Rankgate against vllm-router.

Long prompts are what agents and RAG send: a long system prompt or document that repeats on
every request, and a conversation whose history grows by one turn at a time. A gateway that
tokenizes and hashes the prompt pays for its length on every request unless it remembers what
repeats. Each gateway runs in turn, pinned to ``--gateway-cpu``, in front of one mock engine
(zero latency, DP=2, KV events on) that shares ``--engine-cpu`` with this client, with a
Llama-sized tokenizer (:mod:`llama_tokenizer`). For each prompt size, one request at a time:

- ``system``: the same system prompt of that size, each time with a new question;
- ``history``: one conversation, each request the previous one plus an answer and a new
  question, growing to that size over ``--turns`` requests;
- ``cold``: a chat prompt of that size never sent before (nothing to remember);
- ``cold-completion``: the same as a completion's text prompt;
- ``cold-ids``: a completion whose prompt is that many token ids, never sent before.

It prints p50 and p99 latency, the gateway's CPU per request (``/proc``) and that CPU per KB
of prompt (the request body's prompt field) per shape and size: flat from 16 KB up is cost
linear in the prompt. Rounds run the gateways in turn (reversed every other round), each
started afresh, and the table pools their samples.

    scripts/in-netns .venv/bin/python bench/long_prompts.py [--sizes 1000 8000 32000] \\
        [--rounds 2] [--markdown]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import llama_tokenizer
import orjson
import peers

_TEXT = (
    "the model reads every request and answers with care while the router sends each prompt "
    "to the rank that holds its prefix so that long documents are computed once"
)
WORDS = tuple(_TEXT.split(" "))
SHAPES = ("system", "history", "cold", "cold-completion", "cold-ids")
# Token ids a prompt of ids draws from: inside the Llama-sized tokenizer's vocabulary, clear of
# its added tokens.
ID_RANGE = (100, 30_000)


def filler(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of the Llama-sized tokenizer (three words and a number make
    about four)."""
    return " ".join(f"{rng.choice(WORDS)} {rng.randrange(10_000)}" for _ in range(tokens // 3))


class Unsupported(Exception):
    """The gateway refuses this shape of request outright."""


@dataclass
class Cell:
    latencies: list[float] = field(default_factory=list)
    cpu: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    # Bytes of the prompt field, summed over the measured requests.
    prompt_bytes: int = 0


def bodies(shape: str, size: int, turns: int, seed: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(route, body without model and max_tokens) for each request of ``shape``."""
    if shape in ("cold-completion", "cold-ids"):
        rng = random.Random(seed)
        while True:
            if shape == "cold-ids":
                yield "/v1/completions", {"prompt": rng.choices(range(*ID_RANGE), k=size)}
            else:
                yield "/v1/completions", {"prompt": filler(rng, size)}
    for messages in conversations(shape, size, turns, seed):
        yield "/v1/chat/completions", {"messages": messages}


def prompt_bytes(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(m["content"].encode()) for m in body["messages"])
    prompt = body["prompt"]
    return len(prompt.encode()) if isinstance(prompt, str) else len(orjson.dumps(prompt))


def conversations(shape: str, size: int, turns: int, seed: int) -> Iterator[list[dict[str, str]]]:
    rng = random.Random(seed)
    if shape == "system":
        system = filler(rng, size)
        while True:
            question = f"question {rng.randrange(10**9)}: {filler(rng, 40)}"
            yield [{"role": "system", "content": system}, {"role": "user", "content": question}]
    elif shape == "history":
        step = max(1, size // turns)
        while True:
            messages = [{"role": "system", "content": filler(rng, 200)}]
            for _ in range(turns):
                messages.append({"role": "user", "content": filler(rng, step // 2)})
                yield list(messages)
                messages.append({"role": "assistant", "content": filler(rng, step // 2)})
    else:
        while True:
            yield [{"role": "user", "content": filler(rng, size)}]


def measure(
    gateway: peers.Gateway,
    model: str,
    shape: str,
    size: int,
    args: argparse.Namespace,
    seed: int,
) -> Cell:
    cell = Cell()
    source = bodies(shape, size, args.turns, seed)
    with httpx.Client(base_url=gateway.url, headers=gateway.headers, timeout=120) as http:

        def send(route: str, body: dict[str, Any]) -> float:
            body = {**body, "model": model, "max_tokens": 1}
            start = time.perf_counter()
            reply = http.post(route, json=body)
            elapsed = time.perf_counter() - start
            if reply.status_code == 400 and route == "/v1/completions":
                # vllm-router 0.1.17 over gRPC takes completion prompts as token ids only.
                raise Unsupported(reply.text[:200])
            if reply.status_code != 200:
                raise RuntimeError(f"{gateway.name}: {reply.status_code} {reply.text[:300]}")
            cell.prompt_tokens = max(cell.prompt_tokens, reply.json()["usage"]["prompt_tokens"])
            return elapsed

        # The first sight of a repeated prompt is a cold one, and a gateway's first request of
        # a shape and size pays for what it builds once: one request goes before the count.
        if shape != "history":
            send(*next(source))
        # Short prompts cost a few clock ticks of CPU: more of them, for a reading to 0.1 ms.
        count = args.turns if shape == "history" else max(args.requests, min(200, 400_000 // size))
        requests = [next(source) for _ in range(count)]
        before = gateway.cpu_seconds()
        for route, body in requests:
            cell.latencies.append(send(route, body))
        cell.cpu = gateway.cpu_seconds() - before
        cell.requests = count
        cell.prompt_bytes = sum(prompt_bytes(body) for _, body in requests)
    return cell


def run(args: argparse.Namespace) -> str:
    tokenizer = llama_tokenizer.ensure()
    starters: dict[str, Callable[[ExitStack, peers.Engine], peers.Gateway]] = {
        "rankgate": lambda stack, engine: peers.start_rankgate(
            stack, engine, "kv", cpus=args.gateway_cpu
        ),
        "vllm-router": lambda stack, engine: peers.start_vllm_router(
            stack, engine, "kv_aware", cpus=args.gateway_cpu
        ),
    }
    cells: dict[tuple[str, str, int], Cell] = {}
    tokens: dict[tuple[str, int], int] = {}
    unsupported: dict[tuple[str, str], str] = {}
    context = max(args.sizes) * 2 + 4096
    with tempfile.TemporaryDirectory(prefix="long-prompts-") as work:
        for round_ in range(args.rounds):
            order = args.targets if round_ % 2 == 0 else list(reversed(args.targets))
            for target in order:
                with ExitStack() as stack:
                    engine = peers.start_mock_engine(
                        stack,
                        Path(work),
                        tokenizer=tokenizer,
                        cpus=args.engine_cpu,
                        max_model_len=context,
                        kv_blocks=2 * (context // 16 + 64),
                    )
                    gateway = starters[target](stack, engine)
                    gateway.settle()
                    for shape in args.shapes:
                        for size in args.sizes:
                            seed = 1000 * round_ + size + SHAPES.index(shape)
                            try:
                                cell = measure(gateway, engine.model, shape, size, args, seed)
                            except Unsupported as refused:
                                unsupported[(target, shape)] = str(refused)
                                continue
                            total = cells.setdefault((target, shape, size), Cell())
                            total.latencies += cell.latencies
                            total.cpu += cell.cpu
                            total.requests += cell.requests
                            total.prompt_bytes += cell.prompt_bytes
                            tokens[(shape, size)] = max(
                                tokens.get((shape, size), 0), cell.prompt_tokens
                            )
    rows = []
    for shape in args.shapes:
        for size in args.sizes:
            for target in args.targets:
                if (target, shape) in unsupported:
                    rows.append([shape, str(tokens.get((shape, size), "")), target, *["n/a"] * 5])
                    continue
                cell = cells[(target, shape, size)]
                ordered = sorted(cell.latencies)
                p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
                rows.append(
                    [
                        shape,
                        str(tokens[(shape, size)]),
                        target,
                        f"{statistics.median(ordered) * 1000:.1f}",
                        f"{p99 * 1000:.1f}",
                        f"{cell.cpu / cell.requests * 1000:.2f}",
                        f"{cell.prompt_bytes / cell.requests / 1024:.0f}",
                        f"{cell.cpu / (cell.prompt_bytes / 1024) * 1e6:.0f}",
                    ]
                )
    title = (
        f"Long prompts, one request at a time, mock engine DP=2 at zero latency on CPU "
        f"{args.engine_cpu} with the client, gateway on CPU {args.gateway_cpu}, llama-32k "
        f"tokenizer; {args.rounds} interleaved rounds; {peers.machine()}"
    )
    head = [
        "shape", "prompt tokens (largest)", "gateway", "p50 ms", "p99 ms", "CPU/req ms",
        "prompt KB", "CPU us/KB",
    ]  # fmt: skip
    refusals = "".join(
        f"\n{target} refuses {shape}: {why}" for (target, shape), why in unsupported.items()
    )
    return peers.table(head, rows, title, args.markdown) + refusals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 8000, 32000])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--targets", nargs="+", default=["rankgate", "vllm-router"])
    parser.add_argument("--requests", type=int, default=20, help="per shape and size")
    parser.add_argument("--turns", type=int, default=20, help="requests in a growing history")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gateway-cpu", default="1")
    parser.add_argument("--engine-cpu", default="0")
    parser.add_argument("--markdown", action="store_true")
    print(run(parser.parse_args()))


if __name__ == "__main__":
    main()
