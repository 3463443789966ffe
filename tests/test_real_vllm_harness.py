"""The real-vLLM harness hands out a server that is actually up, with KV events on.

Uses the session's shared server (the ``real_vllm`` fixture wraps ``start_real_vllm``) rather
than starting its own: a second DP=2 engine would cost another ~5 GiB and a minute of startup.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zmq.utils.monitor import recv_monitor_message

from tests.support.engines import EngineUnderTest
from tests.support.real_vllm import RealVllmPair

pytestmark = pytest.mark.real_vllm

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("service", ["", "vllm.Inference", "vllm.Control"])
def test_health_reports_serving(real_vllm: EngineUnderTest, service: str) -> None:
    with grpc.insecure_channel(real_vllm.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert reply.status == SERVING


def test_kv_event_publishers_accept_subscribers(real_vllm: EngineUnderTest) -> None:
    """A ZMTP handshake proves a ZMQ socket listens on each rank's port, not just any TCP."""
    assert real_vllm.kv_events_base_port is not None
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    for rank in range(real_vllm.dp_size):
        sub = context.socket(zmq.SUB)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://{real_vllm.host}:{real_vllm.kv_events_base_port + rank}")
            assert monitor.poll(10_000), f"no ZMQ handshake with rank {rank}'s KV publisher"
            event = recv_monitor_message(monitor)
            assert event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)


def test_each_side_of_the_pair_serves_on_its_own_cpus(real_pd: RealVllmPair) -> None:
    """vLLM starts on every CPU and is confined once it serves: every thread of every process
    in each engine's session, the Rust frontend's and the spinning workers' included."""
    for side in (real_pd.prefill, real_pd.decode):
        assert side.cpus, "the pair is served with --cpus and --decode-cpus"
        placement = _session_affinities(side.pid)
        assert len(placement) > 10, f"only {len(placement)} threads found in {side.pid}'s session"
        assert set(placement.values()) == {frozenset(side.cpus)}, placement


def _session_affinities(session: int) -> dict[int, frozenset[int]]:
    affinities: dict[int, frozenset[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[3]) != session:
                continue
            for tid in os.listdir(f"/proc/{entry}/task"):
                affinities[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
        except (OSError, ValueError):
            continue  # gone meanwhile
    return affinities
