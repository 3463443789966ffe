"""Gateway-level Prometheus metrics, and the ``/metrics`` exposition in one or many processes.

Per request the gateway observes, once when it ends: the count by endpoint, status and model,
end-to-end latency, time to first token, queue time (arrival until the engine request is
sent: body, tokenization, routing), the mean inter-token latency of the request, and tokens in
and out. Observing each token separately would cost CPU on every token of every stream; the
per-request mean keeps the hot path flat and still shows decode slowing down. Label children
are bound once; ``(status, model)`` pairs are bound on first use, with a ceiling so that no
input can grow the series without bound.

With ``--workers N`` prometheus-client runs in multi-process mode (``PROMETHEUS_MULTIPROC_DIR``
set before it is imported): every worker's counters and histograms live in files that any
worker can merge when scraped. Live views (the router's per-rank load, engine health) are
collectors of the scraped worker, added to the merged families by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from sidecar.types import EngineInfo

ENDPOINTS = ("chat", "completions")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# (endpoint, status, model) series beyond this share the model label "other".
MAX_REQUEST_SERIES = 512

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    10,
    20,
    40,
    80,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1,
    2.5,
)
QUEUE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)

EngineProbe = Callable[[], tuple[bool, EngineInfo | None]]


class Observation:
    """What one finished request contributes (seconds; 0 where it never got that far)."""

    __slots__ = (
        "completion_tokens",
        "endpoint",
        "inter_token",
        "model",
        "prompt_tokens",
        "queue",
        "status",
        "total",
        "ttft",
    )

    def __init__(
        self,
        endpoint: str,
        status: int,
        model: str,
        total: float,
        queue: float,
        ttft: float,
        inter_token: float,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        self.endpoint = endpoint
        self.status = status
        self.model = model
        self.total = total
        self.queue = queue
        self.ttft = ttft
        self.inter_token = inter_token
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


class _EndpointSeries:
    __slots__ = ("completion", "inter_token", "latency", "prompt", "queue", "ttft")

    def __init__(self, metrics: GatewayMetrics, endpoint: str) -> None:
        self.latency = metrics.latency.labels(endpoint)
        self.ttft = metrics.ttft.labels(endpoint)
        self.inter_token = metrics.inter_token.labels(endpoint)
        self.queue = metrics.queue.labels(endpoint)
        self.prompt = metrics.prompt_tokens.labels(endpoint)
        self.completion = metrics.completion_tokens.labels(endpoint)


class _EngineCollector(Collector):
    """Engine health as this process sees it, read when scraped."""

    def __init__(self) -> None:
        self.probe: EngineProbe | None = None

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily(
            "rankgate_engine_ready",
            "1 while the engine is discovered and healthy (vLLM's health service says SERVING).",
        )
        info = GaugeMetricFamily(
            "rankgate_engine_info",
            "The engine being served (always 1).",
            labels=["model", "engine_version", "dp_size"],
        )
        probe = self.probe
        healthy, engine = probe() if probe is not None else (False, None)
        ready.add_metric([], 1.0 if healthy else 0.0)
        yield ready
        if engine is not None:
            info.add_metric(
                [engine.served_model_name, engine.engine_version, str(engine.dp_size)], 1.0
            )
            yield info


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.multiproc_dir = os.environ.get(MULTIPROC_ENV) or None
        self.requests = Counter(
            "rankgate_http_requests",
            "OpenAI requests by endpoint, HTTP status and model.",
            ("endpoint", "status", "model"),
            registry=registry,
        )
        self.latency = Histogram(
            "rankgate_http_request_duration_seconds",
            "Time from request to the last byte of the response.",
            ("endpoint",),
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.ttft = Histogram(
            "rankgate_time_to_first_token_seconds",
            "Time from request to the engine's first token (streamed requests).",
            ("endpoint",),
            registry=registry,
            buckets=TTFT_BUCKETS,
        )
        self.inter_token = Histogram(
            "rankgate_inter_token_latency_seconds",
            "Mean time between tokens after the first, one observation per streamed request.",
            ("endpoint",),
            registry=registry,
            buckets=ITL_BUCKETS,
        )
        self.queue = Histogram(
            "rankgate_request_queue_seconds",
            "Time from request to the engine request being sent (decoding, admission, "
            "tokenization, routing).",
            ("endpoint",),
            registry=registry,
            buckets=QUEUE_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "rankgate_prompt_tokens",
            "Prompt tokens of finished requests (vLLM's count, images expanded).",
            ("endpoint",),
            registry=registry,
        )
        self.completion_tokens = Counter(
            "rankgate_completion_tokens",
            "Tokens generated for finished requests.",
            ("endpoint",),
            registry=registry,
        )
        self.in_flight = Gauge(
            "rankgate_http_requests_in_flight",
            "OpenAI requests being served.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self._engine = _EngineCollector()
        registry.register(self._engine)
        self._series = {e: _EndpointSeries(self, e) for e in ENDPOINTS}
        self._requests: dict[tuple[str, int, str], Counter] = {}

    def watch_engine(self, probe: EngineProbe | None) -> None:
        """Report engine health from ``probe`` (None: no engine yet)."""
        self._engine.probe = probe

    def observe(self, done: Observation) -> None:
        key = (done.endpoint, done.status, done.model)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._bind(key)
        counter.inc()
        series = self._series[done.endpoint]
        series.latency.observe(done.total)
        if done.queue > 0.0:
            series.queue.observe(done.queue)
        if done.ttft > 0.0:
            series.ttft.observe(done.ttft)
        if done.inter_token >= 0.0:
            series.inter_token.observe(done.inter_token)
        if done.prompt_tokens:
            series.prompt.inc(done.prompt_tokens)
        if done.completion_tokens:
            series.completion.inc(done.completion_tokens)

    def _bind(self, key: tuple[str, int, str]) -> Counter:
        endpoint, status, model = key
        if len(self._requests) >= MAX_REQUEST_SERIES:
            model = "other"
        counter = self.requests.labels(endpoint, str(status), model)
        if len(self._requests) < 2 * MAX_REQUEST_SERIES:
            self._requests[key] = counter
        return counter

    def exposition(self) -> tuple[bytes, str]:
        """The ``/metrics`` body and content type."""
        if self.multiproc_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        merged = CollectorRegistry()
        collector = MultiProcessCollector(None, self.multiproc_dir)  # type: ignore[no-untyped-call]
        shared: list[Metric] = list(collector.collect())  # type: ignore[no-untyped-call]
        names = {family.name for family in shared}
        local = [f for f in self.registry.collect() if f.name not in names and f.samples]
        merged.register(_Families(shared + local))
        return generate_latest(merged), CONTENT_TYPE_LATEST


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
