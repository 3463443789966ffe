"""Run the mock engine inside a test process, on its own thread and event loop.

Sync tests, async tests on any loop, and benches all use the same handle: it exposes the
target address, per-rank counters read straight from the engine, fault switches, and a way to
run a coroutine on the engine's loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from rankgate.mocker.config import MockEngineConfig
from rankgate.mocker.engine import RankEngine
from rankgate.mocker.faults import Faults
from rankgate.mocker.server import MockServer
from rankgate.mocker.threaded import serving_in_thread
from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc
from tests.conftest import TINY_TOKENIZER
from tests.support.polling import wait_until
from tests.support.ports import free_port, free_port_range

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RankStats:
    """A snapshot of one rank's counters."""

    rank: int
    requests_received: int
    requests_served: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    aborts: int
    preemptions: int
    failed: int
    stranded_transfers: int
    transfers_completed: int
    transferring: int
    # Prefill side: prefills whose KV waits for a decode engine to read it, and how held
    # KV ended (read by a decode engine, or freed at the end of its lease).
    held_transfers: int
    transfers_released: int
    leases_expired: int
    # Decode side: remote prefills read after their lease ended (answered from garbage).
    expired_reads: int
    active: int
    waiting: int
    running: int
    peak_running: int
    leaked: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_batches_published: int
    kv_batches_dropped: int
    kv_next_sequence: int
    busy_seconds: float


class MockFaults:
    """Thread-safe switches for :class:`~rankgate.mocker.faults.Faults`."""

    def __init__(self, handle: MockEngineHandle) -> None:
        self._handle = handle

    @property
    def _faults(self) -> Faults:
        faults = self._handle.server.faults
        assert faults is not None
        return faults

    def kill_engine(self) -> None:
        self._handle.run(self._faults.kill_engine())

    def kill_after_tokens(self, tokens: int) -> None:
        self._handle.call(lambda: self._faults.kill_after_tokens(tokens))

    def slow_steps(self, seconds: float) -> None:
        self._handle.call(lambda: self._faults.slow_steps(seconds))

    def hold_steps(self) -> None:
        self._handle.call(self._faults.hold_steps)

    def release_steps(self) -> None:
        self._handle.call(self._faults.release_steps)

    def revive_engine(self) -> None:
        self._handle.run(self._faults.revive_engine())

    def set_serving(self, serving: bool) -> None:
        self._handle.run(self._faults.set_serving(serving))

    def slow_start(self, seconds: float) -> None:
        self._handle.run(self._faults.slow_start(seconds))

    def flap_health(self, period_s: float, count: int) -> None:
        self._handle.run(self._faults.flap_health(period_s, count))

    def flapping(self) -> bool:
        """Whether health is still being toggled by :meth:`flap_health`."""

        def running() -> bool:
            flapper = self._faults._flapper
            return flapper is not None and not flapper.done()

        return bool(self._handle.call(running))

    def reject_requests(self, count: int = -1, message: str = "engine overloaded") -> None:
        self._handle.call(lambda: self._faults.reject_requests(count, message))

    def restart_kv_publisher(self, rank: int | None = None) -> None:
        self._handle.run(self._faults.restart_kv_publisher(rank))

    def withhold_transfer_params(self, count: int = 1) -> None:
        self._handle.call(lambda: self._faults.withhold_transfer_params(count))

    def drop_kv_batches(self, count: int, rank: int | None = None) -> None:
        self._handle.call(lambda: self._faults.drop_kv_batches(count, rank))

    def distort_kv_events(self, rank: int | None = None, **distortion: Any) -> None:
        self._handle.call(lambda: self._faults.distort_kv_events(rank, **distortion))

    def garble_replies(self, count: int = -1) -> None:
        self._handle.call(lambda: self._faults.garble_replies(count))


class MockEngineHandle:
    def __init__(self, server: MockServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.faults = MockFaults(self)

    @property
    def config(self) -> MockEngineConfig:
        return self.server.config

    @property
    def target(self) -> str:
        return self.server.target

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.config.ranks

    def engine(self, rank: int) -> RankEngine:
        group = self.server.group
        assert group is not None
        return group.engines[rank]

    def stats(self, rank: int) -> RankStats:
        stats: RankStats = self.call(lambda: _snapshot(self.engine(rank)))
        return stats

    def recent_prompts(self, rank: int) -> list[tuple[str, list[int]]]:
        """(request id, expanded prompt ids) of the last requests ``rank`` accepted."""
        prompts: list[tuple[str, list[int]]] = self.call(
            lambda: [(rid, list(ids)) for rid, ids in self.engine(rank).recent_prompts]
        )
        return prompts

    def received_metadata(self, request_id_prefix: str) -> list[dict[str, str | bytes]]:
        """The metadata of the latest Inference calls whose request id starts with
        ``request_id_prefix``, oldest first."""
        found: list[dict[str, str | bytes]] = self.call(
            lambda: [
                dict(metadata)
                for rid, metadata in self.server.received_metadata
                if rid.startswith(request_id_prefix)
            ]
        )
        return found

    def all_stats(self) -> dict[int, RankStats]:
        return {rank: self.stats(rank) for rank in self.ranks}

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, timeout: float = 30.0) -> Any:
        """Call ``fn()`` on the engine's loop (engine state is only touched there)."""
        future: Future[Any] = Future()

        def invoke() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(invoke)
        return future.result(timeout)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no rank holds a request (streams ended and cleaned up)."""
        wait_until(
            lambda: not any(self.active().values()),
            timeout,
            lambda: f"mock engine still has requests in flight: {self.active()}",
        )

    def active(self) -> dict[int, int]:
        """The requests each rank holds."""
        active: dict[int, int] = self.call(
            lambda: {rank: self.engine(rank).active for rank in self.ranks}
        )
        return active


def _snapshot(engine: RankEngine) -> RankStats:
    c = engine.counters
    publisher = engine.publisher
    tracked = set(engine.requests.values())
    scheduled = set(engine.waiting) | set(engine.running) | engine.transferring
    return RankStats(
        rank=engine.rank,
        requests_received=c.requests_received,
        requests_served=c.requests_served,
        prompt_tokens=c.prompt_tokens,
        cached_tokens=c.cached_tokens,
        generated_tokens=c.generated_tokens,
        aborts=c.aborts,
        preemptions=c.preemptions,
        failed=c.failed,
        stranded_transfers=c.stranded_transfers,
        transfers_completed=c.transfers_completed,
        transferring=len(engine.transferring),
        held_transfers=len(engine.held),
        transfers_released=c.transfers_released,
        leases_expired=c.leases_expired,
        expired_reads=c.expired_reads,
        active=engine.active,
        waiting=len(engine.waiting),
        running=len(engine.running),
        peak_running=c.peak_running,
        leaked=len(tracked ^ scheduled),
        kv_blocks_free=engine.cache.num_free,
        kv_blocks_cached=engine.cache.num_cached,
        kv_batches_published=publisher.published if publisher else 0,
        kv_batches_dropped=publisher.dropped if publisher else 0,
        kv_next_sequence=publisher.next_sequence if publisher else 0,
        busy_seconds=c.busy_seconds,
    )


@contextmanager
def running_mock_engine(config: MockEngineConfig) -> Iterator[MockEngineHandle]:
    """Start the mock on a private thread and event loop; stop it (and the thread) on exit."""
    with serving_in_thread(config) as (server, loop):
        yield MockEngineHandle(server, loop)


def kv_mock_config(
    model: str, *, dp_size: int = 2, block_size: int = 16, **fields: Any
) -> MockEngineConfig:
    """A mock on loopback that routing tests talk to: the tiny tokenizer, a KV-event publisher
    and a replay socket per rank on free ports, zero latency and no EOS unless ``fields`` say
    otherwise."""
    settings: dict[str, Any] = {"speed": 0.0, "eos_probability": 0.0, **fields}
    return MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=dp_size,
        block_size=block_size,
        model=model,
        tokenizer=str(TINY_TOKENIZER),
        model_id=str(TINY_TOKENIZER),
        kv_events_port=free_port_range(dp_size),
        kv_replay_port=free_port_range(dp_size),
        **settings,
    )


_direct = itertools.count()


def generate_on(target: str, rank: int, prompt: list[int]) -> None:
    """One token for ``prompt`` straight from the engine at ``target`` on ``rank``, with no
    gateway in between (what another client of the same engine would send)."""
    with grpc.insecure_channel(target) as channel:
        stub: Any = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        stub.Generate(
            inference_pb2.GenerateRequest(
                request_id=f"direct-{rank}-{next(_direct)}-{time.monotonic_ns()}",
                token_ids=inference_pb2.TokenIds(ids=prompt),
                temperature=0.0,
                stopping=inference_pb2.StoppingCriteria(max_new_tokens=1),
            ),
            metadata=(("x-data-parallel-rank", str(rank)),),
            timeout=30,
        )
