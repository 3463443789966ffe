from __future__ import annotations

import logging
from typing import Any

import pytest

from rankgate.sidecar.errors import DiscoveryError
from rankgate.sidecar.kv_sources import publisher_binds, rewrite_wildcard, validate_kv_sources
from rankgate.sidecar.types import KvEventSource
from rankgate.wire.proto.vllm import control_pb2


def source(rank: int | None, endpoint: str = "tcp://*:5557", **fields: Any) -> Any:
    message = control_pb2.KvEventSource(transport="zmq", endpoint=endpoint, **fields)
    if rank is not None:
        message.data_parallel_rank = rank
    return message


def test_empty_list_means_kv_events_off() -> None:
    assert validate_kv_sources([], (0, 1), "10.0.0.5") == ()


def test_one_source_per_rank_sorted_and_rewritten() -> None:
    sources = [
        source(1, "tcp://*:5558", replay_endpoint="tcp://*:6668", topic="kv"),
        source(0, "tcp://[::]:5557", replay_endpoint="tcp://0.0.0.0:6667"),
    ]
    assert validate_kv_sources(sources, (0, 1), "10.0.0.5") == (
        KvEventSource(0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:6667", ""),
        KvEventSource(1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:6668", "kv"),
    )


def test_publishers_that_connect_are_bound_by_the_gateway_at_their_own_address() -> None:
    """vLLM binds only ``*``/``::``/ipc/inproc endpoints and connects to any other, 0.0.0.0
    included; its replay ROUTER always binds, so replay endpoints are rewritten as before."""
    sources = [
        source(0, "tcp://127.0.0.1:5557", replay_endpoint="tcp://0.0.0.0:6667"),
        source(1, "tcp://0.0.0.0:5558"),
    ]
    assert validate_kv_sources(sources, (0, 1), "10.0.0.5") == (
        KvEventSource(0, "tcp://127.0.0.1:5557", "tcp://10.0.0.5:6667", "", bind=True),
        KvEventSource(1, "tcp://0.0.0.0:5558", None, "", bind=True),
    )


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://10.1.1.1:5557", False),
        ("tcp://gateway.local:5557", False),
    ],
)
def test_publisher_bind_rule_is_vllms(endpoint: str, binds: bool) -> None:
    assert publisher_binds(endpoint) is binds


def test_non_zmq_sources_are_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    nats = control_pb2.KvEventSource(transport="nats", endpoint="nats://x", data_parallel_rank=0)
    with caplog.at_level(logging.WARNING):
        assert validate_kv_sources([nats], (0,), "h") == ()
    assert "nats" in caplog.text


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([source(None)], "names no data-parallel rank"),
        ([source(0), source(2)], "outside the served ranks"),
        ([source(0), source(0, "tcp://*:5558")], "two KV-event sources claim"),
        ([source(0, "  "), source(1)], "empty endpoint"),
        ([source(1)], r"no KV-event source for data-parallel ranks \[0\]"),
    ],
)
def test_invalid_source_lists(sources: list[object], message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        validate_kv_sources(sources, (0, 1), "h")


def test_ranks_outside_a_partial_frontend_are_rejected() -> None:
    with pytest.raises(DiscoveryError, match="outside"):
        validate_kv_sources([source(0)], (4, 5, 6, 7), "h")


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", "tcp://h:5557"),
        ("tcp://0.0.0.0:5557", "tcp://h:5557"),
        ("tcp://[::]:5557", "tcp://h:5557"),
        ("tcp://10.1.1.1:5557", "tcp://10.1.1.1:5557"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
        ("inproc://kv", "inproc://kv"),
    ],
)
def test_wildcard_rewrite(endpoint: str, expected: str) -> None:
    assert rewrite_wildcard(endpoint, "h") == expected


def test_wildcard_rewrite_brackets_ipv6_hosts() -> None:
    assert rewrite_wildcard("tcp://*:5557", "::1") == "tcp://[::1]:5557"
