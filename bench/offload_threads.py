"""How late does the event loop wake while big prompts are tokenized on threads beside it?

The gateway tokenizes a big prompt on a worker thread (``app.offload``) so the loop stays free
for short requests. The tokenizers release the GIL while they encode, but take it back to hand
the ids to Python, and a thread that takes it makes the loop wait. This runs the gateway's own
tokenizer (:class:`TextTokenizer`, the Llama-sized one of :mod:`llama_tokenizer`) on pools of
``--threads`` threads at the offload threads' priority, ``--clients`` big prompts of
``--kb`` KB (each new) kept in flight, all on ``--cpus``, while the loop (uvloop) sleeps 1 ms at
a time and records how late each wake-up is. It prints, per pool size, the big prompts encoded
a second and the lateness p50, p99 and max: what a short request beside them waits per
loop turn.

    .venv/bin/python bench/offload_threads.py [--threads 1 2 4 8] [--cpus 1]
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
import uvloop
from long_prompts import WORDS

from rankgate.app.offload import NICENESS
from rankgate.app.prepare.tokenizer import TextTokenizer


def texts(count: int, kilobytes: int) -> list[str]:
    rng = random.Random(7)
    out = []
    for _ in range(count):
        words: list[str] = []
        size = 0
        while size < kilobytes * 1024:
            word = f"{rng.choice(WORDS)} {rng.randrange(100_000)}"
            words.append(word)
            size += len(word) + 1
        out.append(" ".join(words))
    return out


def lower_priority() -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)


async def run(tok: TextTokenizer, base: list[str], threads: int, args: argparse.Namespace) -> str:
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(threads, initializer=lower_priority)
    done = 0
    stop = False

    async def client(k: int) -> None:
        nonlocal done
        n = 0
        while not stop:
            n += 1
            # A new text each time: a prompt never seen, so no piece of it is remembered.
            text = f"{k} {n} " + base[(k + n) % len(base)]
            await loop.run_in_executor(pool, tok.encode, text, False)
            done += 1

    clients = [asyncio.create_task(client(k)) for k in range(args.clients)]
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
    pool.shutdown()
    late.sort()
    return (
        f"{threads:>7}  {rate:10.1f}  {late[len(late) // 2]:8.2f}  "
        f"{late[int(len(late) * 0.99)]:8.2f}  {late[-1]:8.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--clients", type=int, default=8, help="big prompts kept in flight")
    parser.add_argument("--kb", type=int, default=220)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--cpus", default="1", help="CPU list this process runs on")
    args = parser.parse_args()
    cpus = {int(c) for part in args.cpus.split(",") for c in part.split("-") if c}
    os.sched_setaffinity(0, cpus)
    tok = TextTokenizer(llama_tokenizer.ensure())
    tok.fast_checked.wait(300)
    base = texts(16, args.kb)
    print(
        f"{args.clients} big prompts ({args.kb} KB, new each time) in flight on CPUs {args.cpus}; "
        f"tiktoken {'on' if tok.fast else 'off'}; the loop's 1 ms sleeps, how late they wake (ms)"
    )
    print("threads  big prompts/s  late p50  late p99  late max")
    for threads in args.threads:
        print(uvloop.run(run(tok, base, threads, args)), flush=True)


if __name__ == "__main__":
    main()
