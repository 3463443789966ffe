"""How late does the event loop wake while big prompts are tokenized on threads beside it?

The gateway tokenizes a big prompt on a worker thread (``rankgate.app.serving.offload``) so the loop
stays free for short requests. The tokenizers release the GIL while they encode, but take it back to
hand the ids to Python, and a thread that takes it makes the loop wait. This runs the gateway's own
tokenizer (:class:`TextTokenizer`, the Llama-sized one of :mod:`llama_tokenizer`) on pools of
``--threads`` threads at the offload threads' priority, ``--clients`` big prompts of
``--kb`` KB (each new) kept in flight, all on ``--cpus``, while the loop (uvloop) sleeps 1 ms at
a time and records how late each wake-up is. Beside them, a medium prompt of ``--medium-kb``
KB is sent every 50 ms. It prints, per pool size and queue order (``--orders``: ``fifo``, a
``ThreadPoolExecutor``; ``finish``, the gateway's :class:`FinishOrderedPool`), the big prompts
encoded a second, the loop's lateness p50, p99 and max (what a short request beside them waits
per loop turn), and the medium prompts' p50 and p99 time to be encoded.

    .venv/bin/python bench/offload_threads.py [--threads 1 2 4 8] [--orders fifo finish] [--cpus 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_tokenizer
import peers
import uvloop
from big_prompt_stall import text_of

from rankgate.app.serving.offload import NICENESS, FinishOrderedPool
from rankgate.app.tokens.tokenizer import TextTokenizer


def texts(count: int, kilobytes: int) -> list[str]:
    rng = random.Random(7)
    return [text_of(rng, kilobytes) for _ in range(count)]


def lower_priority() -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)


async def run(
    tok: TextTokenizer,
    base: list[str],
    medium: str,
    threads: int,
    order: str,
    args: argparse.Namespace,
) -> str:
    loop = asyncio.get_running_loop()
    fifo = ThreadPoolExecutor(threads, initializer=lower_priority) if order == "fifo" else None
    ordered = FinishOrderedPool(threads, "bench") if order == "finish" else None

    async def encode(text: str) -> list[int]:
        if fifo is not None:
            return await loop.run_in_executor(fifo, tok.encode, text, False)
        assert ordered is not None
        return await asyncio.wrap_future(
            ordered.submit(lambda: tok.encode(text, False), len(text.encode()))
        )

    done = 0
    stop = False
    medium_times: list[float] = []

    async def client(k: int) -> None:
        nonlocal done
        n = 0
        while not stop:
            n += 1
            # A new text each time: a prompt never seen, so no piece of it is remembered.
            text = f"{k} {n} " + base[(k + n) % len(base)]
            await encode(text)
            done += 1

    async def one_medium(n: int) -> None:
        started = time.perf_counter()
        await encode(f"medium {n} " + medium)
        medium_times.append((time.perf_counter() - started) * 1e3)

    async def mediums() -> None:
        sent: list[asyncio.Task[None]] = []
        n = 0
        while not stop:
            n += 1
            sent.append(asyncio.create_task(one_medium(n)))
            await asyncio.sleep(0.05)
        await asyncio.gather(*sent)

    clients = [asyncio.create_task(client(k)) for k in range(args.clients)]
    clients.append(asyncio.create_task(mediums()))
    await asyncio.sleep(1.0)
    late: list[float] = []
    started, before = time.perf_counter(), done
    while time.perf_counter() - started < args.seconds:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        late.append((time.perf_counter() - t - 0.001) * 1e3)
    rate = (done - before) / (time.perf_counter() - started)
    stop = True
    await asyncio.gather(*clients)
    if fifo is not None:
        fifo.shutdown()
    late.sort()
    medium_times.sort()
    return (
        f"{threads:>7}  {order:<6}  {rate:13.1f}  {late[len(late) // 2]:8.2f}  "
        f"{late[int(len(late) * 0.99)]:8.2f}  {late[-1]:8.2f}  "
        f"{medium_times[len(medium_times) // 2]:10.1f}  "
        f"{medium_times[int(len(medium_times) * 0.99)]:10.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--clients", type=int, default=8, help="big prompts kept in flight")
    parser.add_argument("--kb", type=int, default=220)
    parser.add_argument("--medium-kb", type=int, default=20)
    parser.add_argument(
        "--orders", nargs="+", choices=("fifo", "finish"), default=["fifo", "finish"]
    )
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--cpus", default="1", help="CPU list this process runs on")
    parser.add_argument("--tokenizer", choices=("llama-32k", "tiny"), default="llama-32k")
    args = parser.parse_args()
    cpus = {int(c) for part in args.cpus.split(",") for c in part.split("-") if c}
    os.sched_setaffinity(0, cpus)
    directory = peers.TINY_TOKENIZER if args.tokenizer == "tiny" else llama_tokenizer.ensure()
    tok = TextTokenizer(directory)
    tok.fast_checked.wait(300)
    base = texts(16, args.kb)
    medium = texts(1, args.medium_kb)[0]
    print(
        f"{args.clients} big prompts ({args.kb} KB, new each time) in flight on CPUs {args.cpus}; "
        f"tiktoken {'on' if tok.fast else 'off'}; the loop's 1 ms sleeps, how late they wake (ms)"
    )
    print("threads  order   big prompts/s  late p50  late p99  late max  medium p50  medium p99")
    for threads in args.threads:
        for order in args.orders:
            print(uvloop.run(run(tok, base, medium, threads, order, args)), flush=True)


if __name__ == "__main__":
    main()
