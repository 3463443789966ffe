"""The per-rank engine: prefix-cache hits in TTFT, load in ITL, LRU eviction, preemption."""

from __future__ import annotations

import threading
import time

from tests.mocker.conftest import BLOCK, Client, Events, engine, prompt, request
from tests.support.mock_engine import MockEngineHandle
from tests.support.polling import wait_until


def ttft(client: Client, tokens: list[int], rank: int) -> float:
    started = time.perf_counter()
    stream = client.inference.GenerateStream(
        request(tokens, max_new_tokens=1), metadata=(("x-data-parallel-rank", str(rank)),)
    )
    next(stream)  # prompt_info
    next(stream)  # first token
    elapsed = time.perf_counter() - started
    list(stream)
    return elapsed


def test_prefix_cache_hits_show_up_in_ttft() -> None:
    with engine(speed=1.0, prefill_seconds_per_token=0.0008, decode_step_seconds=0.001) as handle:
        c = Client(handle.target)
        try:
            tokens = prompt(1, 256)
            cold = ttft(c, tokens, 0)
            warm = ttft(c, tokens, 0)
            other_rank = ttft(c, tokens, 1)
            stats = handle.stats(0)
            assert stats.cached_tokens == (256 - 1) // BLOCK * BLOCK
            assert cold > 0.15
            assert warm < cold / 3
            assert other_rank > 0.15, "rank 1 has its own cache"
        finally:
            c.close()


def test_bypass_prefix_cache_recomputes() -> None:
    with engine() as handle:
        c = Client(handle.target)
        try:
            tokens = prompt(2, 64)
            c.stream(request(tokens), rank=0)
            bypass = request(tokens)
            bypass.kv.bypass_prefix_cache = True
            c.stream(bypass, rank=0)
            assert handle.stats(0).cached_tokens == 0
            c.stream(request(tokens), rank=0)
            assert handle.stats(0).cached_tokens == 48
        finally:
            c.close()


def per_token_seconds(handle: MockEngineHandle, concurrency: int) -> float:
    durations: list[float] = []

    def worker(seed: int) -> None:
        c = Client(handle.target)
        try:
            stream = c.inference.GenerateStream(
                request(prompt(seed, 8), max_new_tokens=10),
                metadata=(("x-data-parallel-rank", "0"),),
            )
            next(stream)
            next(stream)
            started = time.perf_counter()
            list(stream)
            durations.append((time.perf_counter() - started) / 9)
        finally:
            c.close()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return sum(durations) / len(durations)


def test_decode_steps_slow_down_with_batch_size() -> None:
    with engine(speed=1.0, decode_step_seconds=0.002, decode_seconds_per_sequence=0.002) as handle:
        alone = per_token_seconds(handle, 1)
        crowded = per_token_seconds(handle, 12)
        assert alone < 0.015
        assert crowded > 2 * alone


def test_speed_factor_scales_time() -> None:
    with engine(speed=4.0, prefill_seconds_per_token=0.0008, decode_step_seconds=0.001) as h:
        c = Client(h.target)
        try:
            fast = ttft(c, prompt(3, 256), 0)
            assert fast < 0.15
        finally:
            c.close()


def test_a_slow_rank_steps_longer_for_the_same_work() -> None:
    """A rank at a quarter speed spends four times the modelled step time on the same prompt,
    and answers it the same."""
    config = dict(speed=1.0, prefill_seconds_per_token=0.0001, decode_step_seconds=0.001)
    with engine(rank_speeds=(0.25,), **config) as handle:
        c = Client(handle.target)
        try:
            tokens = prompt(7, 128)
            slow = c.stream(request(tokens, max_new_tokens=4, request_id="r"), rank=0)
            fast = c.stream(request(tokens, max_new_tokens=4, request_id="r"), rank=1)
            assert slow == fast
            ratio = handle.stats(0).busy_seconds / handle.stats(1).busy_seconds
            assert abs(ratio - 4.0) < 1e-6
        finally:
            c.close()


def test_lru_eviction_publishes_removals() -> None:
    # 8 blocks per rank besides the null block: a second 96-token prompt forces most of the
    # first one out.
    with engine(total_kv_blocks=18, max_model_len=128) as handle:
        c = Client(handle.target)
        listener = Events(handle)
        try:
            first, second = prompt(4, 96), prompt(5, 96)
            c.stream(request(first, max_new_tokens=2), rank=0)
            c.stream(request(second, max_new_tokens=2), rank=0)
            listener.pump(0.3)
            stored = listener.events(0, "BlockStored")
            removed = listener.events(0, "BlockRemoved")
            first_hashes = stored[0]["block_hashes"]
            assert len(first_hashes) == 6
            evicted = [h for event in removed for h in event["block_hashes"]]
            # Released tail first, so the tail is evicted first and the head survives.
            assert evicted == list(reversed(first_hashes[1:]))
            before = handle.stats(0).cached_tokens
            c.stream(request(first, max_new_tokens=2), rank=0)
            assert handle.stats(0).cached_tokens - before == BLOCK
            assert handle.stats(0).kv_blocks_free == 8
        finally:
            listener.close()
            c.close()


def test_running_out_of_blocks_preempts_and_still_finishes() -> None:
    with engine(
        total_kv_blocks=14, max_model_len=96, speed=1.0, decode_step_seconds=0.001
    ) as handle:
        results: list[int] = []

        def worker(seed: int) -> None:
            c = Client(handle.target)
            try:
                messages = c.stream(request(prompt(seed, 40), max_new_tokens=30), rank=1)
                results.append(messages[-1].outputs.finish_info.num_output_tokens)
            finally:
                c.close()

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results == [30, 30, 30]
        assert handle.stats(1).preemptions > 0
        handle.wait_idle()
        assert handle.stats(1).leaked == 0


def test_max_running_requests_bounds_the_batch() -> None:
    with engine(max_running_requests=2, speed=1.0, decode_step_seconds=0.02) as handle:
        streams = []
        c = Client(handle.target)
        try:
            for seed in range(4):
                stream = c.inference.GenerateStream(
                    request(prompt(seed, 8), max_new_tokens=100),
                    metadata=(("x-data-parallel-rank", "0"),),
                )
                next(stream)
                streams.append(stream)
            wait_until(
                lambda: (handle.stats(0).running, handle.stats(0).waiting) == (2, 2),
                10,
                lambda: f"rank 0: {handle.stats(0)}",
            )
        finally:
            for stream in streams:
                stream.cancel()
            c.close()


def test_paced_steps_give_every_stream_one_token_per_step() -> None:
    # 30 ms steps: ten streams over both ranks, ten tokens each, all in the same ~10 steps.
    with engine(paced_step_seconds=0.03, speed=0.0) as handle:
        started = time.perf_counter()
        results: list[list[float]] = []
        together = threading.Barrier(10)

        def worker(seed: int) -> None:
            c = Client(handle.target)
            try:
                together.wait(10)
                stream = c.inference.GenerateStream(
                    request(prompt(seed, 8), max_new_tokens=10),
                    metadata=(("x-data-parallel-rank", str(seed % 2)),),
                )
                arrivals = [time.perf_counter() - started for message in stream]
                results.append(arrivals[1:])
            finally:
                c.close()

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(results) == 10
        steps = handle.call(lambda: sum(handle.engine(r).counters.steps for r in (0, 1)))
        # Each rank ran about ten steps for its five streams, not fifty.
        assert 20 <= steps <= 30
        for arrivals in results:
            assert len(arrivals) == 10
            assert 0.02 < (arrivals[-1] - arrivals[0]) / 9 < 0.06
