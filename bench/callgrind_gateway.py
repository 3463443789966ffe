"""How many instructions does the gateway execute per request and per streamed token?

Wall-clock CPU figures on a shared machine are noise at the scale of one change; instruction
counts are not. This runs ``rankgate serve`` under callgrind (collection off), in front of the
mock engine (DP=2, KV events on, the Llama-sized tokenizer of :mod:`peers_overhead`), warms it
up, then switches instrumentation on for each phase alone and dumps it:

- ``--requests`` non-streaming chat requests of ``--short-tokens`` tokens: Ir per request
  (phase ``chat``: one conversation throughout; ``chat-unique``: a new question in each);
- ``--streams`` streams of ``--short-tokens`` and of ``--long-tokens`` tokens, the engine
  paced (``--step-ms``, long enough that a gateway slowed by callgrind still reads one message
  per token): Ir per token is the slope between the two, so per-request costs cancel.

Each phase's profile stays in ``--out`` (``callgrind_annotate`` reads it).

    scripts/in-netns .venv/bin/python bench/callgrind_gateway.py [--requests 200] [--streams 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_tokenizer
import peers
from peers_overhead import MESSAGES, body

from tests.support.ports import free_port


def asked(model: str, stream: bool, tokens: int, unique: int | None) -> dict[str, object]:
    """The bench's request; with ``unique``, its last message asks a question of its own (no
    render, tokenizer or prefix the gateway has seen)."""
    request = body(model, stream, tokens)
    if unique is None:
        return request
    messages = [dict(message) for message in MESSAGES]
    messages[-1]["content"] += f" Question {unique}: item {unique * 7919 % 100003}."
    return {**request, "messages": messages}


async def drive(
    url: str, model: str, n: int, concurrency: int, stream: bool, tokens: int, unique: bool = False
) -> int:
    """``n`` requests, ``concurrency`` at a time; returns the chunks with choices received."""
    queue = iter(range(n))
    chunks = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal chunks
            for i in queue:
                request = asked(model, stream, tokens, i if unique else None)
                if not stream:
                    reply = await client.post("/v1/chat/completions", json=request)
                    reply.raise_for_status()
                    assert reply.json()["usage"]["completion_tokens"] == tokens
                    continue
                got = 0
                async with client.stream("POST", "/v1/chat/completions", json=request) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if event.get("usage"):
                                got = event["usage"]["completion_tokens"]
                            chunks += bool(event["choices"])
                assert got == tokens, got

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return chunks


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def dumped_ir(out: Path, pid: int, label: str) -> int:
    """Dump the counters collected since the last dump under ``label``; their total Ir."""
    before = set(out.parent.glob(f"{out.name}*"))
    control(pid, "--instr=off")
    control(pid, "--dump=" + label)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for path in set(out.parent.glob(f"{out.name}*")) - before:
            text = path.read_text(errors="replace")
            match = re.search(r"^totals: (\d+)", text, re.M)
            if match:
                return int(match.group(1))
        time.sleep(0.5)
    raise RuntimeError("callgrind wrote no dump")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=250.0, help="paced decode step")
    parser.add_argument("--tokenizer", choices=("llama-32k", "tiny"), default="llama-32k")
    parser.add_argument("--phases", nargs="+", default=["chat", "stream"])
    parser.add_argument("--out", type=Path, default=Path("/tmp/rankgate-callgrind/gw"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for old in args.out.parent.glob(f"{args.out.name}*"):
        old.unlink()
    tokenizer = peers.TINY_TOKENIZER if args.tokenizer == "tiny" else llama_tokenizer.ensure()
    work = Path("/tmp/rankgate-callgrind/work")
    work.mkdir(parents=True, exist_ok=True)
    n, c = args.requests, args.concurrency
    results: list[str] = []
    with ExitStack() as stack:
        engine = peers.start_mock_engine(
            stack, work, tokenizer=tokenizer, paced_step_seconds=args.step_ms / 1e3
        )
        port = free_port()
        argv = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--vgdb=yes",
            f"--callgrind-out-file={args.out}.%p",
            sys.executable, "-m", "rankgate.app.cli", "serve", "--engine", engine.target,
            "--port", str(port), "--tokenizer", str(engine.model_dir), "--policy", "kv",
            "--log-level", "warning",
        ]  # fmt: skip
        proc = peers.launch(stack, argv, "rankgate-callgrind")
        url = f"http://127.0.0.1:{port}"
        peers.wait_http(url, [proc], "/ready", timeout=600)
        model = engine.model
        asyncio.run(drive(url, model, 2 * c, c, False, args.short_tokens))
        asyncio.run(drive(url, model, c, c, True, args.short_tokens))
        if "chat" in args.phases:
            control(proc.pid, "--instr=on")
            asyncio.run(drive(url, model, n, c, False, args.short_tokens))
            ir = dumped_ir(args.out, proc.pid, "chat")
            results.append(f"non-streaming chat: {ir / n / 1e6:.3f} M Ir per request ({n})")
        if "chat-unique" in args.phases:
            control(proc.pid, "--instr=on")
            asyncio.run(drive(url, model, n, c, False, args.short_tokens, unique=True))
            ir = dumped_ir(args.out, proc.pid, "chat-unique")
            per_request = ir / n / 1e6
            results.append(f"non-streaming chat, new questions: {per_request:.3f} M Ir per request")
        if "stream" in args.phases:
            per_stream: list[float] = []
            per_chunks: list[float] = []
            for tokens in (args.short_tokens, args.long_tokens):
                control(proc.pid, "--instr=on")
                chunks = asyncio.run(drive(url, model, args.streams, c, True, tokens))
                ir = dumped_ir(args.out, proc.pid, f"stream{tokens}")
                per_stream.append(ir / args.streams)
                per_chunks.append(chunks / args.streams)
                results.append(
                    f"stream {tokens} tokens: {ir / args.streams / 1e6:.3f} M Ir per stream, "
                    f"{chunks / args.streams:.1f} chunks per stream"
                )
            slope = (per_stream[1] - per_stream[0]) / (args.long_tokens - args.short_tokens)
            results.append(f"streaming: {slope / 1e3:.1f} k Ir per token (marginal)")
            if per_chunks[1] > per_chunks[0]:
                chunk = (per_stream[1] - per_stream[0]) / (per_chunks[1] - per_chunks[0])
                results.append(f"streaming: {chunk / 1e3:.1f} k Ir per chunk (marginal)")
    print(f"gateway under callgrind, {args.tokenizer} tokenizer, concurrency {c}")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
