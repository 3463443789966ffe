"""What does per-rank admission cost a request, uncontended and under overload?

Drives ``rankgate.sidecar.admission.Admission`` directly, the way ``Sidecar.generate`` does (one
``fits`` per request, one ``take`` per engine stream on launch, one ``give`` when it ends), on
a DP layout of ``--ranks`` ranks:

- uncontended: nobody waits, so a request costs the comparisons and counter updates alone;
- overloaded: every slot is held, ``--waiters`` requests wait (a mix of pinned and unpinned,
  random priorities), and slots are handed on one at a time: the cost of each hand-off (the
  grant, the woken waiter's fresh take, the event loop's wake-up).

    .venv/bin/python bench/admission_overhead.py [--requests 200000] [--ranks 8] [--waiters 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from rankgate.sidecar.admission import Admission, AdmissionConfig
from rankgate.sidecar.types import EngineInfo, RankCapacity


def engine_info(ranks: int, max_running: int) -> EngineInfo:
    return EngineInfo(
        model_id="bench",
        served_model_name="bench",
        aliases=(),
        engine_version="0.32.0",
        instance_id="bench",
        max_model_len=4096,
        block_size=16,
        dp_size=ranks,
        ranks=tuple(range(ranks)),
        capacity=tuple(RankCapacity(rank, 1000, max_running) for rank in range(ranks)),
        max_batched_tokens=8192,
        supports_text_input=True,
        supports_lora=False,
        supports_multimodal=False,
        reasoning_parser="",
        tool_call_parser="",
    )


def uncontended(ranks: int, requests: int) -> float:
    """Nanoseconds per request: admit, take a slot on a rank, give it back."""
    gate = Admission(AdmissionConfig())
    gate.configure(engine_info(ranks, 128))
    start = time.perf_counter_ns()
    for i in range(requests):
        key = gate.key_of(None)
        if gate.fits(key, 1):
            slot = gate.key_of(i % ranks)
            assert slot is not None
            gate.take(slot)
            gate.give(slot)
    return (time.perf_counter_ns() - start) / requests


async def overloaded(ranks: int, waiters: int) -> tuple[float, int]:
    """Microseconds per hand-off with ``waiters`` queued; and how many waited at most."""
    rng = random.Random(7)
    gate = Admission(AdmissionConfig(per_rank=1, queue=waiters, timeout=600))
    gate.configure(engine_info(ranks, 1))
    for rank in range(ranks):
        gate.take(rank)
    done = asyncio.Event()
    finished = 0

    async def one() -> None:
        nonlocal finished
        key = rng.choice([None, None, rng.randrange(ranks)])
        await gate.wait(key, 1, rng.randrange(-3, 4))
        slot = key if key is not None else next(r for r in range(ranks) if gate.room(r) > 0)
        gate.take(slot)
        gate.settle()
        await asyncio.sleep(0)
        gate.give(slot)
        finished += 1
        if finished == waiters:
            done.set()

    tasks = [asyncio.create_task(one()) for _ in range(waiters)]
    await asyncio.sleep(0)
    peak = gate.waiting
    start = time.perf_counter_ns()
    for rank in range(ranks):
        gate.give(rank)
    await done.wait()
    elapsed = time.perf_counter_ns() - start
    await asyncio.gather(*tasks)
    assert gate.in_use == 0
    assert gate.waiting == 0
    return elapsed / waiters / 1e3, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--waiters", type=int, default=2000)
    args = parser.parse_args()
    best = min(uncontended(args.ranks, args.requests) for _ in range(3))
    per_handoff, peak = asyncio.run(overloaded(args.ranks, args.waiters))
    print(f"per-rank admission, {args.ranks} ranks")
    print(f"{'case':<34}{'figure':>12}")
    print(f"{'uncontended, per request (best/3)':<34}{best:>9.0f} ns")
    print(f"{f'overloaded ({peak} waiting), per grant':<34}{per_handoff:>9.1f} us")


if __name__ == "__main__":
    main()
