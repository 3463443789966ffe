"""Both gRPC service layouts, served by the mock: vLLM 0.32's (KV-event discovery on
``vllm.Control``) and vLLM main's split one (on ``vllm.KvTransfer``, Control answering
UNIMPLEMENTED for it, health per service name). Discovery, health, KV-aware routing and
prefill/decode work through the gateway against either."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.server import create_app
from rankgate.mocker.config import GrpcServices
from rankgate.mocker.transfer import Role
from rankgate.wire.proto.vllm import control_pb2, control_pb2_grpc, kv_transfer_pb2_grpc
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.mock_engine import MockEngineHandle, kv_mock_config, running_mock_engine
from tests.support.polling import wait_until

MODEL = "layout-llm"
DP = 2
BLOCK = 16
LAYOUTS: list[GrpcServices] = ["combined", "split"]


def mock(layout: GrpcServices, role: Role = "both") -> Any:
    return running_mock_engine(
        kv_mock_config(MODEL, dp_size=DP, block_size=BLOCK, grpc_services=layout, role=role)
    )


def serve(*flags: str) -> Any:
    argv = ["serve", "--tokenizer", str(TINY_TOKENIZER), "--startup-timeout", "30", *flags]
    return serve_app(create_app(settings_from_args(build_parser().parse_args(argv))))


def chat(http: httpx.Client, text: str, rank: int | None = None) -> httpx.Response:
    headers = {} if rank is None else {"x-data-parallel-rank": str(rank)}
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2},
        headers=headers,
    )
    assert response.status_code == 200, response.text
    return response


@pytest.fixture(params=LAYOUTS)
def engine(request: pytest.FixtureRequest) -> Iterator[MockEngineHandle]:
    with mock(request.param) as handle:
        yield handle


def test_kv_event_discovery_is_where_the_layout_puts_it(engine: MockEngineHandle) -> None:
    split = engine.config.grpc_services == "split"
    with grpc.insecure_channel(engine.target) as channel:
        control: Any = control_pb2_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]
        moved: Any = kv_transfer_pb2_grpc.KvTransferStub(channel)  # type: ignore[no-untyped-call]
        health: Any = health_pb2_grpc.HealthStub(channel)
        request = control_pb2.GetKvEventSourcesRequest()
        asked, other = (moved, control) if split else (control, moved)
        assert len(asked.GetKvEventSources(request, timeout=10).sources) == DP
        with pytest.raises(grpc.RpcError) as raised:
            other.GetKvEventSources(request, timeout=10)
        assert raised.value.code() is grpc.StatusCode.UNIMPLEMENTED
        for service in ("vllm.Inference", "vllm.Control"):
            check = health_pb2.HealthCheckRequest(service=service)
            assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        check = health_pb2.HealthCheckRequest(service="vllm.KvTransfer")
        if split:
            assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        else:
            with pytest.raises(grpc.RpcError):
                health.Check(check, timeout=10)


def test_the_gateway_routes_on_kv_events_under_either_layout(engine: MockEngineHandle) -> None:
    text = f"{os.urandom(6).hex()} " + "a long shared opening that fills blocks " * 8
    with serve("--engine", engine.target) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/ready").status_code == 200
        chat(http, text, rank=1)
        routes: list[str] = []

        def routed_on_rank_1s_events() -> bool:
            routes.append(chat(http, text).headers["x-rankgate-route"])
            return routes[-1].startswith("rank=1;") and "cached=0/" not in routes[-1]

        wait_until(
            routed_on_rank_1s_events,
            10,
            lambda: f"never routed on rank 1's KV events: {routes[-1]}",
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_and_decode_work_under_either_layout(layout: GrpcServices) -> None:
    with ExitStack() as stack:
        prefill = stack.enter_context(mock(layout, "prefill"))
        decode = stack.enter_context(mock(layout, "decode"))
        url = stack.enter_context(
            serve(
                "--prefill-engine",
                prefill.target,
                "--decode-engine",
                decode.target,
                "--pd-prefill",
                "remote",
            )
        )
        http = stack.enter_context(httpx.Client(base_url=url, timeout=60))
        body = chat(http, "split the work, please").json()
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 2
        assert sum(s.requests_served for s in prefill.all_stats().values()) == 1
        assert sum(s.requests_served for s in decode.all_stats().values()) == 1
