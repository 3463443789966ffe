"""Faults on demand, observed the way a client of vLLM would observe them."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.mocker.conftest import Client, engine, prompt, request
from tests.support.polling import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_of(client: Client, service: str = "vllm.Inference") -> int:
    stub = health_pb2_grpc.HealthStub(client.channel)
    status: int = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    return status


def test_slow_start_reports_not_serving_then_serving() -> None:
    with engine(startup_delay_s=0.4, kv_events_port=None) as handle:
        c = Client(handle.target)
        try:
            assert health_of(c) == NOT_SERVING
            assert health_of(c, "") == NOT_SERVING
            wait_until(lambda: health_of(c) == SERVING, 10, "SERVING after the start-up delay")
            assert health_of(c, "vllm.Control") == SERVING
        finally:
            c.close()


def test_engine_death_mid_stream() -> None:
    with engine(kv_events_port=None) as handle:
        c = Client(handle.target)
        try:
            handle.faults.kill_after_tokens(3)
            with pytest.raises(grpc.RpcError) as caught:
                c.stream(request(prompt(1, 20), max_new_tokens=50))
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "fatal" in (caught.value.details() or "")
            wait_until(lambda: health_of(c) == NOT_SERVING, 10, "health NOT_SERVING")
            with pytest.raises(grpc.RpcError) as refused:
                c.stream(request(prompt(2, 20)))
            assert refused.value.code() == grpc.StatusCode.INTERNAL
            assert handle.stats(0).failed == 1
            handle.faults.revive_engine()
            assert health_of(c) == SERVING
            assert c.stream(request(prompt(2, 20)))[-1].outputs.finish_info.num_output_tokens == 4
        finally:
            c.close()


def test_kill_engine_fails_streams_in_flight() -> None:
    with engine(kv_events_port=None, speed=1.0, decode_step_seconds=0.02) as handle:
        c = Client(handle.target)
        try:
            stream = c.inference.GenerateStream(
                request(prompt(3, 20), max_new_tokens=500), timeout=30
            )
            next(stream)
            next(stream)
            handle.faults.kill_engine()
            with pytest.raises(grpc.RpcError) as caught:
                list(stream)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            handle.wait_idle()
            assert all(handle.stats(rank).leaked == 0 for rank in handle.ranks)
        finally:
            c.close()


def test_rejected_requests_get_resource_exhausted() -> None:
    with engine(kv_events_port=None) as handle:
        c = Client(handle.target)
        try:
            handle.faults.reject_requests(2, "queue full")
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as caught:
                    c.stream(request(prompt(4, 10)))
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert caught.value.details() == "queue full"
            assert c.stream(request(prompt(4, 10)))[-1].outputs.finish_info.num_output_tokens == 4
            assert handle.stats(0).requests_received == 1
        finally:
            c.close()


def test_health_flapping_returns_to_serving() -> None:
    with engine(kv_events_port=None) as handle:
        c = Client(handle.target)
        try:
            assert health_of(c) == SERVING
            handle.faults.flap_health(0.1, 3)
            wait_until(lambda: health_of(c) == NOT_SERVING, 10, "health NOT_SERVING")
            wait_until(lambda: not handle.faults.flapping(), 10, "the flapping over")
            assert health_of(c) == SERVING
        finally:
            c.close()


def test_held_steps_keep_requests_where_they_are_until_released() -> None:
    with engine(kv_events_port=None) as handle:
        c = Client(handle.target)
        lengths: list[int] = []

        def ask(seed: int) -> None:
            final = c.stream(request(prompt(seed, 20)))[-1]
            lengths.append(final.outputs.finish_info.num_output_tokens)

        def held() -> int:
            return sum(s.running + s.waiting for s in handle.all_stats().values())

        threads = [threading.Thread(target=ask, args=(seed,)) for seed in (5, 6)]
        try:
            handle.faults.hold_steps()
            for thread in threads:
                thread.start()
            wait_until(lambda: held() == 2, 10, lambda: f"the engine holds {held()} of 2")
            stats = handle.all_stats().values()
            assert sum(s.generated_tokens + s.requests_served for s in stats) == 0
            assert lengths == []
            handle.faults.release_steps()
            for thread in threads:
                thread.join(30)
            assert lengths == [4, 4]
        finally:
            handle.faults.release_steps()
            c.close()
