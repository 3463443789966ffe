"""KV-event ingestion rate and routing decision time with a large index.

1. Ingestion: vLLM-format batches (array envelope, map events, 16-token blocks chained by
   parent) are published on real ZMQ PUB sockets, one per rank; the clock stops when the
   router's intake thread has applied the last one. Reported as events/s and blocks/s.
2. Decisions: with ``--blocks`` indexed blocks per rank, ``KvRouter.route`` for prompts that
   share a prefix with some ranks; p50/p99 per decision, hashing included, after ``--warmup``
   untimed ones, with the minor page faults taken meanwhile. The bookkeeping the gateway does
   once the request is sent (``router.sent()``) and when it ends is timed apart.
   Beside them, a control: fixed pure-Python work of the decisions' median length, timed as
   often, whose p99 is the machine's own tail at that length.
3. The block-hash mix: CPython's tuple hash (what the router uses) against blake2b.
4. A long prompt's predictions: ``PredictedIndex`` entering a 3,400-block prompt (55k tokens)
   at a rank's capacity, as the gateway does on its event loop once the prompt is sent.

    PYTHONPATH=. .venv/bin/python bench/routing_index.py [--ranks 4] [--blocks 100000]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import hashlib
import os
import random
import resource
import statistics
import time

from prometheus_client import CollectorRegistry

from rankgate.app.serving.gc_tuning import tune_after_startup
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.hashing import prompt_keys
from rankgate.sidecar.routing.index import PredictedIndex
from rankgate.sidecar.routing.policies import KvRouter, build_router
from rankgate.sidecar.types import KvEventSource
from tests.routing.conftest import engine_info, prepared
from tests.routing.publisher import TestPublisher, stored

BLOCK = 16
BLOCKS_PER_EVENT = 8
EVENTS_PER_BATCH = 32
DOC_BLOCKS = 64


def _documents(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(100, 50000) for _ in range(DOC_BLOCKS * BLOCK)] for _ in range(count)]


def _batches(rank: int, docs: list[list[int]]) -> list[list[dict[str, object]]]:
    """Every document as chained BlockStored events, grouped into batches."""
    events: list[dict[str, object]] = []
    ident = rank << 40
    for doc in docs:
        parent: int | None = None
        for start in range(0, DOC_BLOCKS, BLOCKS_PER_EVENT):
            hashes = list(range(ident + start, ident + start + BLOCKS_PER_EVENT))
            tokens = doc[start * BLOCK : (start + BLOCKS_PER_EVENT) * BLOCK]
            events.append(stored(hashes, tokens, parent=parent, block_size=BLOCK))
            parent = hashes[-1]
        ident += DOC_BLOCKS
    return [events[i : i + EVENTS_PER_BATCH] for i in range(0, len(events), EVENTS_PER_BATCH)]


async def _ingest(args: argparse.Namespace) -> None:
    rng = random.Random(1)
    docs_per_rank = args.blocks // DOC_BLOCKS
    shared = _documents(rng, docs_per_rank // 2)
    publishers = [TestPublisher(rank, replay=False) for rank in range(args.ranks)]
    registry = CollectorRegistry()
    router = build_router(
        RoutingConfig(pending_ttl=args.pending_ttl, regret_keys=args.regret_keys), registry
    )
    assert isinstance(router, KvRouter)
    sources = [KvEventSource(p.rank, p.endpoint, None, p.topic) for p in publishers]
    router.configure(
        engine_info(
            range(args.ranks),
            block_size=BLOCK,
            kv_blocks=args.blocks + 1024,
            max_running=256,
            sources=sources,
        )
    )
    await router.start()
    for publisher in publishers:
        await asyncio.to_thread(publisher.wait_subscribed)

    # Each rank holds half of the shared documents (overlapping ranks) plus its own.
    docs = []
    for rank in range(args.ranks):
        mine = shared[rank * len(shared) // (2 * args.ranks) :][: len(shared) // 2]
        docs.append(mine + _documents(rng, docs_per_rank - len(mine)))
    batches = [_batches(rank, docs[rank]) for rank in range(args.ranks)]
    total_events = sum(len(b) for per_rank in batches for b in per_rank)
    total_batches = sum(len(per_rank) for per_rank in batches)

    def applied() -> float:
        return sum(
            registry.get_sample_value(
                "rankgate_kv_event_batches_total", {"rank": str(r), "origin": "live"}
            )
            or 0.0
            for r in range(args.ranks)
        )

    rss_before = _rss()
    # As the gateway does once started (rankgate/app/serving/gc_tuning.py): what exists now (here
    # the bench's own 50k prepared events) leaves every later collection, and young passes are
    # rarer.
    tune_after_startup()
    payload_start = time.perf_counter()
    for index in range(max(len(b) for b in batches)):
        for rank, publisher in enumerate(publishers):
            if index < len(batches[rank]):
                publisher.publish(batches[rank][index])
    published = time.perf_counter() - payload_start
    while applied() < total_batches:  # noqa: ASYNC110 - the counter is the only signal
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - payload_start
    indexed = [
        router.view.events.size(slot) if router.view.events else 0 for slot in range(args.ranks)
    ]
    grown = _rss() - rss_before
    blocks = total_events * BLOCKS_PER_EVENT
    print(f"ingestion: {args.ranks} ranks, {total_batches} batches, {total_events} events")
    print(
        f"  {total_events / elapsed:,.0f} events/s  {blocks / elapsed:,.0f} blocks/s  "
        f"({elapsed:.2f}s; publishing alone {published:.2f}s)"
    )
    print(f"  indexed blocks per rank: {indexed}")
    events = router.view.events
    distinct = len(events.device) if events is not None else 0
    print(
        f"  {distinct:,} distinct blocks, {sum(indexed):,} rank entries; the process grew "
        f"{grown / 2**20:.0f} MiB while indexing: {grown / max(distinct, 1):.0f} bytes per "
        f"distinct block"
    )

    # Decisions: half the prompts extend a document some ranks hold, half are new.
    prompts = []
    for n in range(args.warmup + args.decisions):
        rank_docs = docs[n % args.ranks]
        if n % 2 == 0:
            doc = rank_docs[rng.randrange(len(rank_docs))]
            cut = rng.randrange(8, DOC_BLOCKS) * BLOCK
            prompt = doc[:cut] + [rng.randrange(100, 50000) for _ in range(args.tail)]
        else:
            prompt = [rng.randrange(100, 50000) for _ in range(args.prompt_tokens)]
        prompts.append(prepared(prompt, f"d{n}"))
    # Warm-up decisions first, untimed: the router's tables grow to their working size. The
    # timed ones store their figures in arrays allocated beforehand: a result list growing
    # during the loop touches new pages while the decisions run, and on some virtual machines
    # a first touch costs tens of microseconds (it set this bench's p99 before).
    warmup_faults = _minor_faults()
    for request in prompts[: args.warmup]:
        ticket = router.route(request)
        router.sent()
        ticket.finished()
    warmup_faults = _minor_faults() - warmup_faults
    measured = prompts[args.warmup :]
    times = array.array("d", bytes(8 * len(measured)))
    cpu = array.array("d", bytes(8 * len(measured)))
    after = array.array("d", bytes(8 * len(measured)))
    hits = 0
    faults_before = _minor_faults()
    for n, request in enumerate(measured):
        started = time.perf_counter_ns()
        started_cpu = time.thread_time_ns()
        ticket = router.route(request)
        cpu[n] = (time.thread_time_ns() - started_cpu) / 1000
        times[n] = (time.perf_counter_ns() - started) / 1000
        # What the gateway does once the request is on its way, and when it ends.
        started = time.perf_counter_ns()
        router.sent()
        ticket.finished()
        after[n] = (time.perf_counter_ns() - started) / 1000
        hits += ticket.decision.cached_tokens > 0
    faults = _minor_faults() - faults_before
    times = array.array("d", sorted(times))
    cpu = array.array("d", sorted(cpu))
    load = await asyncio.to_thread(_loadavg)
    mean_tokens = statistics.fmean(len(p.prompt_token_ids) for p in measured)
    print(
        f"decisions: {len(times)} prompts (mean {mean_tokens:.0f} tokens, {hits} with hits), "
        f"{args.blocks:,} blocks indexed per rank; 1-min load average {load}"
    )
    print(
        f"  minor page faults: {faults} in the timed decisions, {warmup_faults} in the "
        f"{args.warmup} before them"
    )
    for label, values in (("wall", times), ("thread CPU", cpu)):
        print(
            f"  {label:<10} p50 {values[len(values) // 2]:6.0f} us  "
            f"p99 {values[int(len(values) * 0.99)]:6.0f} us  "
            f"mean {statistics.fmean(values):6.0f} us"
        )
    print(
        f"  after the decision (router.sent() once the request is on its way, and its end): "
        f"mean {statistics.fmean(after):.0f} us"
    )
    _control(times[len(times) // 2], len(times))
    await router.close()
    for publisher in publishers:
        publisher.close()


def _minor_faults() -> int:
    """Minor page faults of this thread so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def _control(median_us: float, repeat: int) -> None:
    """The machine's own tail: one fixed piece of pure-Python work, sized to the decisions'
    median, timed as often as they were. Its p99 over its p50 is what the machine adds to any
    work of that length (interrupts, a shared core's neighbours), the decision aside."""

    def work(rounds: int) -> int:
        total = 0
        for value in range(rounds):
            total += value * value % 7
        return total

    rounds = 1000
    started = time.perf_counter_ns()
    work(rounds)
    per_round = (time.perf_counter_ns() - started) / 1000 / rounds
    rounds = max(1, int(median_us / max(per_round, 1e-3)))
    samples = array.array("d", bytes(8 * repeat))
    for n in range(repeat):
        started = time.perf_counter_ns()
        work(rounds)
        samples[n] = (time.perf_counter_ns() - started) / 1000
    samples = array.array("d", sorted(samples))
    p50, p99 = samples[len(samples) // 2], samples[int(len(samples) * 0.99)]
    print(
        f"  control (fixed work of the median's length): p50 {p50:6.0f} us  p99 {p99:6.0f} us "
        f"({p99 / p50:.2f}x)"
    )


def _long_prompt_settle(blocks: int, capacity: int, prompts: int) -> None:
    """``PredictedIndex.record`` and ``settle`` for prompts of ``blocks`` new keys on two
    ranks of ``capacity`` blocks each: past the first few, every key evicts one."""
    rng = random.Random(3)
    now = [0.0]
    predicted = PredictedIndex([capacity, capacity], 30.0, lambda: now[0])
    keys = [[rng.getrandbits(62) for _ in range(blocks)] for _ in range(prompts)]
    started = time.perf_counter()
    for n, prompt in enumerate(keys):
        now[0] += 0.01
        predicted.record(n % 2, prompt)
        predicted.settle()
    per = (time.perf_counter() - started) / prompts
    print(f"  {per * 1e3:.2f} ms per {blocks}-block prompt ({per / blocks * 1e9:.0f} ns a block)")


def _hash_mix(tokens: int, repeat: int) -> None:
    rng = random.Random(2)
    prompt = tuple(rng.randrange(50000) for _ in range(tokens))

    def blake() -> None:
        packed = memoryview(array.array("I", prompt).tobytes())
        digest = hashlib.blake2b(digest_size=8)
        for start in range(0, len(packed) - BLOCK * 4 + 1, BLOCK * 4):
            digest.update(packed[start : start + BLOCK * 4])
            digest.copy().digest()

    for name, run in (
        ("tuple hash (used)", lambda: prompt_keys(prompt, BLOCK)),
        ("blake2b", blake),
    ):
        started = time.perf_counter()
        for _ in range(repeat):
            run()
        per = (time.perf_counter() - started) / repeat * 1e6
        print(f"  {name:<18} {per:8.0f} us per {tokens}-token prompt ({tokens // BLOCK} blocks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=100_000, help="indexed blocks per rank")
    parser.add_argument("--decisions", type=int, default=2000, help="timed route decisions")
    parser.add_argument(
        "--warmup", type=int, default=500, help="route decisions before the timed ones"
    )
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--tail", type=int, default=200)
    parser.add_argument(
        "--regret-keys",
        type=int,
        default=RoutingConfig().regret_keys,
        help="--route-regret-keys: 0 routes without checking predictions",
    )
    parser.add_argument(
        "--pending-ttl",
        type=float,
        default=0.0,
        help="--route-pending-ttl: seconds routed prompts count as cached before their events "
        f"(the gateway's default is {RoutingConfig().pending_ttl:g}; 0: the events alone)",
    )
    args = parser.parse_args()
    asyncio.run(_ingest(args))
    print("block-hash mix:")
    _hash_mix(2048, 200)
    print("a long prompt's predictions (entered on the event loop once it is sent):")
    _long_prompt_settle(blocks=3400, capacity=8192, prompts=40)


if __name__ == "__main__":
    main()
