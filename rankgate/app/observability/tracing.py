"""OpenTelemetry traces of requests, from the client's ``traceparent`` into vLLM.

Off unless ``--otlp-traces-endpoint`` is given (vLLM's flag), and then it needs the
``tracing`` extra. Each OpenAI request gets a server span that continues the client's W3C
trace context, with children for its preparation (render, tokenize, images) and, inside the
sidecar through :class:`rankgate.sidecar.types.RequestTrace`, for admission, the router's choice
(rank, cached tokens, policy) and every engine call. An engine call's span context is sent
to vLLM as ``traceparent``/``tracestate`` metadata, so vLLM's own spans join the trace.

When tracing is off nothing here runs: requests carry ``trace = None`` and each hook is one
``is None`` test.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Mapping
from typing import TypeVar

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rankgate.sidecar import Metadata

log = logging.getLogger(__name__)

T = TypeVar("T")
_PROPAGATOR = TraceContextTextMapPropagator()
INSTRUMENTATION = "rankgate"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def otlp_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter vLLM would use for ``endpoint``: gRPC unless
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says ``http/protobuf``."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: use grpc or http/protobuf")


class Tracing:
    """The process's tracer; ``begin`` opens one request's trace."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer(INSTRUMENTATION)

    @classmethod
    def to_endpoint(cls, endpoint: str) -> Tracing:
        attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME", "rankgate")}
        provider = TracerProvider(resource=Resource.create(attributes))
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter(endpoint)))
        log.info("tracing to %s", endpoint)
        return cls(provider)

    def begin(
        self, method: str, path: str, headers: Mapping[str, str], request_id: str
    ) -> RequestSpans:
        parent = _PROPAGATOR.extract(headers)
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path,
                "rankgate.request_id": request_id,
            },
        )
        return RequestSpans(self.tracer, span)

    def shutdown(self) -> None:
        self.provider.shutdown()


class _CallSpan:
    """One engine call's span (:class:`rankgate.sidecar.types.EngineCallTrace`)."""

    __slots__ = ("_span", "metadata")

    def __init__(self, span: Span) -> None:
        self._span = span
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
        self.metadata: Metadata = tuple(carrier.items())

    def end(self, error: str | None = None) -> None:
        span = self._span
        if not span.is_recording():
            return
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


class RequestSpans:
    """One request's trace: its server span and the children the app and the sidecar add
    (:class:`rankgate.sidecar.types.RequestTrace`)."""

    __slots__ = ("_context", "_tracer", "span")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self._tracer = tracer
        self.span = span
        self._context = set_span_in_context(span)

    def _child(
        self,
        name: str,
        start_ns: int,
        attributes: dict[str, str | int | bool],
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Span:
        return self._tracer.start_span(
            name, context=self._context, kind=kind, attributes=attributes, start_time=start_ns
        )

    async def prepare(self, work: Awaitable[T]) -> T:
        """``work`` (the request's preparation) inside a ``rankgate.prepare`` span."""
        span = self._child("rankgate.prepare", time.time_ns(), {})
        try:
            return await work
        except Exception as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        finally:
            span.end()

    def admission(self, waited: bool, start_ns: int, error: str | None = None) -> None:
        span = self._child("rankgate.admission", start_ns, {"rankgate.admission.waited": waited})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def routed(
        self,
        choice: int,
        rank: int | None,
        cached_tokens: int,
        prompt_tokens: int,
        policy: str,
        reason: str,
        start_ns: int,
    ) -> None:
        attributes: dict[str, str | int | bool] = {
            "rankgate.choice": choice,
            "rankgate.route.cached_tokens": cached_tokens,
            "rankgate.route.prompt_tokens": prompt_tokens,
            "rankgate.route.policy": policy,
            "rankgate.route.reason": reason,
        }
        if rank is not None:
            attributes["rankgate.route.rank"] = rank
        self._child("rankgate.route", start_ns, attributes).end()

    def engine_call(self, choice: int, rank: int | None, method: str) -> _CallSpan:
        attributes: dict[str, str | int | bool] = {
            "rpc.system": "grpc",
            "rpc.service": "vllm.Inference",
            "rpc.method": method,
            "rankgate.choice": choice,
        }
        if rank is not None:
            attributes["rankgate.route.rank"] = rank
        span = self._child(f"vllm.Inference/{method}", time.time_ns(), attributes, SpanKind.CLIENT)
        return _CallSpan(span)

    def end(self, status: int) -> None:
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
