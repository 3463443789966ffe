"""OpenTelemetry through the gateway: one trace from the client's traceparent into the
engine call, whose span context the mock engine receives as gRPC metadata."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.observability.tracing import Tracing
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.support.engines import EngineUnderTest
from tests.support.polling import wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(mock_vllm: EngineUnderTest, exporter: InMemorySpanExporter) -> Iterator[httpx.Client]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = GatewaySettings(engine=mock_vllm.target, tokenizer=str(mock_vllm.tokenizer_dir))
    with (
        serve_app(create_app(settings, tracing=Tracing(provider))) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


def spans_of(exporter: InMemorySpanExporter, server_name: str) -> list[ReadableSpan]:
    """The spans of the one trace whose server span is ``server_name``, once it ended."""
    spans: list[ReadableSpan] = []

    def ended() -> bool:
        spans[:] = exporter.get_finished_spans()
        return any(s.name == server_name for s in spans)

    wait_until(ended, 10, lambda: f"no {server_name} span among {[s.name for s in spans]}")
    exporter.clear()
    return spans


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def check_trace(
    spans: list[ReadableSpan], server_name: str, calls: int, admissions: int = 1
) -> list[ReadableSpan]:
    assert {hex_id(s.context.trace_id, 32) for s in spans} == {TRACE_ID}
    [server] = [s for s in spans if s.name == server_name]
    assert server.kind == SpanKind.SERVER
    assert server.parent is not None
    assert hex_id(server.parent.span_id, 16) == CLIENT_SPAN
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 200
    names = sorted(s.name for s in spans if s is not server)
    engine_calls = [s for s in spans if s.name.startswith("vllm.Inference/")]
    assert len(engine_calls) == calls
    assert names.count("rankgate.route") == calls
    assert names.count("rankgate.prepare") == 1
    # One admission per client request (a completions batch is admitted whole).
    assert names.count("rankgate.admission") == admissions
    for span in spans:
        if span is not server:
            assert span.parent is not None
            assert span.parent.span_id == server.context.span_id
    route = next(s for s in spans if s.name == "rankgate.route")
    assert route.attributes is not None
    assert route.attributes["rankgate.route.policy"] == "kv"
    assert route.attributes["rankgate.route.rank"] in (0, 1)
    assert route.attributes["rankgate.route.cached_tokens"] >= 0  # type: ignore[operator]
    for call in engine_calls:
        assert call.kind == SpanKind.CLIENT
        assert call.end_time is not None
    return engine_calls


def sent_traceparents(engine: EngineUnderTest, request_id: str) -> set[str]:
    received = engine.mock.received_metadata(request_id)
    return {str(m["traceparent"]) for m in received if "traceparent" in m}


@pytest.mark.parametrize("stream", [False, True])
def test_one_trace_from_the_client_into_the_engine(
    traced: httpx.Client,
    exporter: InMemorySpanExporter,
    mock_vllm: EngineUnderTest,
    stream: bool,
) -> None:
    request_id = f"traced-{stream}"
    response = traced.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llama",
            "messages": MESSAGES,
            "max_tokens": 4,
            "n": 2,
            "stream": stream,
            "request_id": request_id,
        },
        headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"},
    )
    assert response.status_code == 200, response.text
    calls = check_trace(
        spans_of(exporter, "POST /v1/chat/completions"), "POST /v1/chat/completions", 2
    )
    method = "GenerateStream" if stream else "Generate"
    assert {c.name for c in calls} == {f"vllm.Inference/{method}"}
    # Each engine call carried its own span's context to the engine.
    expected = {f"00-{TRACE_ID}-{hex_id(c.context.span_id, 16)}-01" for c in calls}
    assert sent_traceparents(mock_vllm, request_id) == expected
    received = mock_vllm.mock.received_metadata(request_id)
    assert {m.get("tracestate") for m in received} == {"vendor=1"}


def test_responses_and_completions_are_traced_too(
    traced: httpx.Client, exporter: InMemorySpanExporter, mock_vllm: EngineUnderTest
) -> None:
    headers = {"traceparent": TRACEPARENT}
    body: dict[str, Any] = {"model": "tiny-llama", "input": "hi", "max_output_tokens": 2}
    assert traced.post("/v1/responses", json=body, headers=headers).status_code == 200
    check_trace(spans_of(exporter, "POST /v1/responses"), "POST /v1/responses", 1)
    body = {"model": "tiny-llama", "prompt": ["a", "b"], "max_tokens": 2, "request_id": "tc"}
    assert traced.post("/v1/completions", json=body, headers=headers).status_code == 200
    check_trace(spans_of(exporter, "POST /v1/completions"), "POST /v1/completions", 2, 1)


def test_a_request_without_traceparent_starts_its_own_trace(
    traced: httpx.Client, exporter: InMemorySpanExporter
) -> None:
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2}
    assert traced.post("/v1/chat/completions", json=body).status_code == 200
    spans = spans_of(exporter, "POST /v1/chat/completions")
    [server] = [s for s in spans if s.kind == SpanKind.SERVER]
    assert server.parent is None
    assert len({s.context.trace_id for s in spans}) == 1


def test_a_refused_request_ends_its_span_with_the_status(
    traced: httpx.Client, exporter: InMemorySpanExporter
) -> None:
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 100000}
    response = traced.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 400
    spans = spans_of(exporter, "POST /v1/chat/completions")
    [server] = [s for s in spans if s.kind == SpanKind.SERVER]
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 400
    assert not any(s.name.startswith("vllm.Inference/") for s in spans)


def test_without_tracing_no_trace_context_reaches_the_engine(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2, "request_id": "untraced"}
    response = mock_http.post(
        "/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}
    )
    assert response.status_code == 200
    received = mock_vllm.mock.received_metadata("untraced")
    assert received
    assert not any("traceparent" in m for m in received)
