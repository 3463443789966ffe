"""Do big prompts in flight stall everyone else? Short requests' latency alone and beside them.

Operators of other routers report more than a second spent on a 220 KB prompt; a gateway that
tokenizes and hashes prompts must do that work without holding up the short requests that
arrive meanwhile. Each gateway runs in turn, pinned to ``--gateway-cpu``, in front of one
engine (zero latency, DP=2) on ``--engine-cpu`` with this client, with a Llama-sized
tokenizer: our mock (KV events on), or with ``--engine node`` the Node fake
(``bench/node_engine.mjs``), which reads a big prompt without work of its own. For each gateway:

- ``alone``: short chat requests (about 60 tokens, ``max_tokens`` 1) at ``--rate`` a second,
  open loop, for ``--seconds``;
- ``beside``: the same short requests while ``--big`` clients each keep one big request in
  flight, back to back: a chat (or, with ``--completions``, a completion) whose prompt is
  ``--big-kb`` KB of text never sent before, so nothing is remembered.

The short requests come from a process of their own at normal priority (the big clients' threads
run at ``nice`` +10), and each is followed by one of the same size sent straight to the engine
over gRPC: what the engine itself adds beside the big prompts, apart from the gateway. It
prints the short requests' p50 and p99 in both phases and their ratio, the engine's own, the big
requests finished, and the gateway's CPU. Rounds alternate the gateways.

    scripts/in-netns .venv/bin/python bench/big_prompt_stall.py [--big 8] [--big-kb 220] \\
        [--rounds 2] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import random
import shlex
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import llama_tokenizer
import peers
from long_prompts import WORDS


def text_of(rng: random.Random, kilobytes: int) -> str:
    words: list[str] = []
    size = 0
    while size < kilobytes * 1024:
        word = f"{rng.choice(WORDS)} {rng.randrange(100_000)}"
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


@dataclass
class Phase:
    short: list[float] = field(default_factory=list)
    # The same short requests sent straight to the engine (gRPC, token ids): its own part.
    direct: list[float] = field(default_factory=list)
    big_done: int = 0
    big_seconds: list[float] = field(default_factory=list)
    cpu: float = 0.0
    seconds: float = 0.0


def short_body(model: str, rng: random.Random) -> dict[str, Any]:
    question = " ".join(rng.choice(WORDS) for _ in range(40))
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{rng.randrange(10**9)} {question}"}],
        "max_tokens": 1,
    }


@functools.cache
def big_texts(kilobytes: int) -> tuple[str, ...]:
    """A few texts made once: the client's own CPU must not set the pace on a shared core."""
    rng = random.Random(kilobytes)
    return tuple(text_of(rng, kilobytes) for _ in range(4))


def big_body(model: str, rng: random.Random, kilobytes: int, completions: bool) -> dict[str, Any]:
    # A number no other request starts with: the whole prompt is new to every cache.
    text = f"{rng.randrange(10**12)} {rng.choice(big_texts(kilobytes))}"
    if completions:
        return {"model": model, "prompt": text, "max_tokens": 1}
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}


def run_phase(
    gateway: peers.Gateway, engine: peers.Engine, args: argparse.Namespace, big: int, seed: int
) -> Phase:
    model = engine.model
    phase = Phase()
    stop = threading.Event()
    lock = threading.Lock()
    path = "/v1/completions" if args.completions else "/v1/chat/completions"

    def big_client(index: int) -> None:
        # Below the short client's priority, so the load generator does not delay it.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        rng = random.Random(seed * 100 + index)
        with httpx.Client(base_url=gateway.url, headers=gateway.headers, timeout=300) as http:
            while not stop.is_set():
                body = big_body(model, rng, args.big_kb, args.completions)
                start = time.perf_counter()
                reply = http.post(path, json=body)
                if reply.status_code != 200:
                    raise RuntimeError(f"big: {reply.status_code} {reply.text[:200]}")
                with lock:
                    phase.big_done += 1
                    phase.big_seconds.append(time.perf_counter() - start)

    big_texts(args.big_kb)
    threads = [threading.Thread(target=big_client, args=(i,), daemon=True) for i in range(big)]
    for thread in threads:
        thread.start()
    if big:
        time.sleep(args.warmup)
    # The short requests come from a process of their own, at the normal priority: in this one
    # they would wait for the big clients' GIL and core, and that wait is the client's, not
    # the gateway's.
    spawn = multiprocessing.get_context("spawn")
    results: multiprocessing.queues.Queue[tuple[list[float], list[float]]] = spawn.Queue()
    go = spawn.Event()
    shorts = spawn.Process(
        target=_short_client,
        args=(gateway, engine.target, model, args.rate, args.seconds, seed, go, results),
    )
    shorts.start()
    results.get(timeout=60)  # started, its imports done
    before = gateway.cpu_seconds()
    started = time.perf_counter()
    go.set()
    phase.short, phase.direct = results.get(timeout=args.seconds + 120)
    shorts.join(30)
    phase.seconds = time.perf_counter() - started
    phase.cpu = gateway.cpu_seconds() - before
    stop.set()
    for thread in threads:
        thread.join(300)
    return phase


def _short_client(
    gateway: peers.Gateway,
    engine: str,
    model: str,
    rate: float,
    seconds: float,
    seed: int,
    go: multiprocessing.synchronize.Event,
    results: multiprocessing.queues.Queue[tuple[list[float], list[float]]],
) -> None:
    """Short chat requests at ``rate`` a second for ``seconds``, open loop, from ``go``, each
    followed by one of the same size straight to the engine: both latencies (after an empty
    pair once the process is ready)."""
    import grpc

    from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc

    results.put(([], []))
    go.wait()
    rng = random.Random(seed)
    interval = 1.0 / rate
    latencies: list[float] = []
    direct: list[float] = []
    with (
        httpx.Client(base_url=gateway.url, headers=gateway.headers, timeout=60) as http,
        grpc.insecure_channel(engine) as channel,
    ):
        generate = inference_pb2_grpc.InferenceStub(channel).Generate  # type: ignore[no-untyped-call]
        started = due = time.perf_counter()
        while time.perf_counter() - started < seconds:
            due += interval
            body = short_body(model, rng)
            sent = time.perf_counter()
            reply = http.post("/v1/chat/completions", json=body)
            if reply.status_code != 200:
                raise RuntimeError(f"short: {reply.status_code} {reply.text[:200]}")
            latencies.append(time.perf_counter() - sent)
            ids = [rng.randrange(100, 30000) for _ in range(reply.json()["usage"]["prompt_tokens"])]
            request = inference_pb2.GenerateRequest(
                request_id=f"direct-{seed}-{len(direct)}",
                token_ids=inference_pb2.TokenIds(ids=ids),
                stopping=inference_pb2.StoppingCriteria(max_new_tokens=1),
            )
            sent = time.perf_counter()
            generate(request, timeout=60)
            direct.append(time.perf_counter() - sent)
            time.sleep(max(0.0, due - time.perf_counter()))
    results.put((latencies, direct))


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def run(args: argparse.Namespace) -> str:
    tokenizer = llama_tokenizer.ensure()
    starters: dict[str, Callable[[ExitStack, peers.Engine], peers.Gateway]] = {
        "rankgate": lambda stack, engine: peers.start_rankgate(
            stack, engine, "kv", shlex.split(args.rankgate_args), cpus=args.gateway_cpu
        ),
        "vllm-router": lambda stack, engine: peers.start_vllm_router(
            stack, engine, "kv_aware", cpus=args.gateway_cpu
        ),
    }
    phases: dict[tuple[str, str], Phase] = {}
    context = args.big_kb * 1024 // 3 + 4096
    with tempfile.TemporaryDirectory(prefix="big-prompts-") as work:
        for round_ in range(args.rounds):
            order = args.targets if round_ % 2 == 0 else list(reversed(args.targets))
            for target in order:
                with ExitStack() as stack:
                    if args.engine == "node":
                        engine = peers.start_node_engine(
                            stack,
                            Path(work),
                            tokenizer=tokenizer,
                            cpus=args.engine_cpu,
                            max_model_len=context,
                        )
                    else:
                        engine = peers.start_mock_engine(
                            stack,
                            Path(work),
                            tokenizer=tokenizer,
                            cpus=args.engine_cpu,
                            max_model_len=context,
                            kv_blocks=2 * (context // 16 + 64) * max(1, args.big),
                        )
                    gateway = starters[target](stack, engine)
                    gateway.settle()
                    for name, big in (("alone", 0), ("beside", args.big)):
                        got = run_phase(gateway, engine, args, big, seed=round_ * 7 + big)
                        total = phases.setdefault((target, name), Phase())
                        total.short += got.short
                        total.direct += got.direct
                        total.big_done += got.big_done
                        total.big_seconds += got.big_seconds
                        total.cpu += got.cpu
                        total.seconds += got.seconds
    rows = []
    for target in args.targets:
        alone, beside = phases[(target, "alone")], phases[(target, "beside")]
        rows.append(
            [
                target,
                f"{statistics.median(alone.short) * 1000:.1f} / {p99(alone.short) * 1000:.1f}",
                f"{statistics.median(beside.short) * 1000:.1f} / {p99(beside.short) * 1000:.1f}",
                f"{p99(beside.short) / p99(alone.short):.2f}x",
                f"{statistics.median(alone.direct) * 1000:.1f} / {p99(alone.direct) * 1000:.1f}",
                f"{statistics.median(beside.direct) * 1000:.1f} / {p99(beside.direct) * 1000:.1f}",
                f"{beside.big_done / beside.seconds:.1f}",
                f"{statistics.median(beside.big_seconds) * 1000:.0f}"
                if beside.big_seconds
                else "-",
                f"{beside.cpu / beside.seconds * 100:.0f}%",
            ]
        )
    kind = "completions" if args.completions else "chat"
    title = (
        f"Short chat requests at {args.rate}/s alone and beside {args.big} clients each keeping "
        f"a cold {args.big_kb} KB {kind} request in flight; {args.engine} engine DP=2 at zero "
        f"latency on "
        f"CPU {args.engine_cpu} with the client, gateway on CPU {args.gateway_cpu}, llama-32k "
        f"tokenizer; {args.rounds} interleaved rounds of {args.seconds:g} s; {peers.machine()}"
    )
    head = [
        "gateway",
        "short alone p50 / p99 ms",
        "beside big p50 / p99 ms",
        "p99 ratio",
        "engine direct alone p50 / p99 ms",
        "engine direct beside p50 / p99 ms",
        "big done/s",
        "big p50 ms",
        "gateway core",
    ]
    return peers.table(head, rows, title, args.markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", type=int, default=8, help="big requests kept in flight")
    parser.add_argument("--big-kb", type=int, default=220)
    parser.add_argument("--completions", action="store_true", help="big ones as completions")
    parser.add_argument("--rate", type=float, default=20.0, help="short requests a second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--targets", nargs="+", default=["rankgate", "vllm-router"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gateway-cpu", default="1")
    parser.add_argument("--engine-cpu", default="0")
    parser.add_argument(
        "--engine",
        choices=("mock", "node"),
        default="mock",
        help="our mock (KV events on), or the Node fake (bench/node_engine.mjs), which "
        "reads a big prompt without work of its own and publishes no KV events",
    )
    parser.add_argument(
        "--rankgate-args",
        default="",
        help="more flags for rankgate serve, for one-change controls "
        "(for example --rankgate-args='--route-regret-keys 0')",
    )
    parser.add_argument("--markdown", action="store_true")
    print(run(parser.parse_args()))


if __name__ == "__main__":
    main()
