"""The DP group behind one endpoint: pinned ranks, range checks and vLLM's own balancer."""

from __future__ import annotations

import threading

import grpc
import pytest

from rankgate.mocker.config import ConfigError, MockEngineConfig
from rankgate.wire.proto.vllm import control_pb2
from tests.mocker.conftest import Client, engine, prompt, request
from tests.support.mock_engine import MockEngineHandle
from tests.support.polling import wait_until


@pytest.mark.parametrize(
    ("size", "start", "local", "ranks"),
    [(2, 0, 0, (0, 1)), (8, 0, 4, (0, 1, 2, 3)), (8, 4, 4, (4, 5, 6, 7))],
)
def test_served_ranks(size: int, start: int, local: int, ranks: tuple[int, ...]) -> None:
    config = MockEngineConfig(dp_size=size, dp_start_rank=start, dp_local_size=local)
    assert config.ranks == ranks


@pytest.mark.parametrize(("size", "start", "local"), [(0, 0, 0), (8, 4, 0), (8, 0, 9), (8, 4, 5)])
def test_invalid_topologies_are_refused(size: int, start: int, local: int) -> None:
    with pytest.raises(ConfigError):
        MockEngineConfig(dp_size=size, dp_start_rank=start, dp_local_size=local)


def test_partial_group_reports_and_checks_its_ranks() -> None:
    with engine(dp_size=4, dp_start_rank=2, dp_local_size=2, kv_events_port=None) as handle:
        c = Client(handle.target)
        try:
            info = c.control.GetServerInfo(control_pb2.GetServerInfoRequest(), timeout=5)
            assert info.parallelism.data_parallel_size == 4
            assert info.parallelism.data_parallel_rank == 2
            assert info.parallelism.data_parallel_size_local == 2
            c.stream(request(prompt(1, 8)), rank=3)
            assert handle.stats(3).requests_served == 1
            with pytest.raises(grpc.RpcError) as caught:
                c.stream(request(prompt(1, 8)), rank=0)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() == (
                "engine-core error: data parallel rank 0 is not connected to this frontend; "
                "connected ranks: [2, 3]"
            )
        finally:
            c.close()


@pytest.mark.parametrize("value", ["a", "-1", "1.5", "4294967296"])
def test_bad_rank_metadata(client: Client, value: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(
            client.inference.GenerateStream(
                request(prompt(2, 8)), metadata=(("x-data-parallel-rank", value),), timeout=5
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "x-data-parallel-rank metadata must be an unsigned 32-bit integer"
    )


def test_sequential_requests_all_land_on_the_first_rank() -> None:
    """As observed on real vLLM: an idle group always scores rank 0 lowest."""
    with engine() as handle:
        c = Client(handle.target)
        try:
            for seed in range(4):
                c.stream(request(prompt(seed, 20)))
            assert handle.stats(0).requests_served == 4
            assert handle.stats(1).requests_served == 0
        finally:
            c.close()


def test_concurrent_requests_spread_by_load() -> None:
    """Least ``waiting * 4 + running`` wins, so in-flight requests alternate ranks."""
    with engine(speed=1.0, decode_step_seconds=0.05) as handle:
        streams = []
        c = Client(handle.target)
        try:
            for seed in range(4):
                stream = c.inference.GenerateStream(
                    request(prompt(10 + seed, 20), max_new_tokens=200), timeout=30
                )
                next(stream)
                streams.append(stream)
                # Running, not waiting: the next request is routed by the load it adds.
                wait_until(
                    lambda: sum(s.running for s in handle.all_stats().values()) == len(streams),
                    10,
                    lambda: f"{handle.all_stats()}",
                )
            running = {rank: handle.stats(rank).active for rank in handle.ranks}
            assert running == {0: 2, 1: 2}
        finally:
            for stream in streams:
                stream.cancel()
            c.close()


def test_balancer_ignores_the_kv_cache() -> None:
    """A prompt cached on rank 1 still goes to rank 0 when rank 0 is less loaded."""
    with engine() as handle:
        c = Client(handle.target)
        try:
            warm = prompt(20, 64)
            c.stream(request(warm), rank=1)
            c.stream(request(warm))
            assert handle.stats(0).requests_served == 1
            assert handle.stats(0).cached_tokens == 0
        finally:
            c.close()


def test_thread_safety_of_counters(mock: MockEngineHandle) -> None:
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(50):
                mock.all_stats()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(10)
    assert not errors
