"""grpc.health.v1 as vLLM's split-service frontend answers it."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conformance.helpers import RPC_TIMEOUT_S, rpc_error

pytestmark = pytest.mark.timeout(120)

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("service", ["", "vllm.Inference", "vllm.Control"])
def test_service_is_serving(engine_channel: grpc.Channel, service: str) -> None:
    stub = health_pb2_grpc.HealthStub(engine_channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
    assert reply.status == SERVING


def test_unknown_service_is_not_found(engine_channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(engine_channel)
    error = rpc_error(
        lambda: stub.Check(
            health_pb2.HealthCheckRequest(service="vllm.NoSuchService"), timeout=RPC_TIMEOUT_S
        )
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
