"""Gateway-level Prometheus metrics, and the ``/metrics`` exposition in one or many processes.

Per request the gateway observes, once when it ends: the count by endpoint, status and model,
end-to-end latency, time to first token, queue time (arrival until the engine request is
sent: body, tokenization, routing), the mean inter-token latency of the request, and tokens in
and out. Observing each token separately would cost CPU on every token of every stream; the
per-request mean keeps the hot path flat and still shows decode slowing down.
``(status, model)`` series are added on first use, with a ceiling so that no input can grow
the series without bound.

In one process the observations are plain additions to numbers that a collector turns into
the Prometheus families when ``/metrics`` is scraped, instead of locked client-library
increments on every request.

With ``--workers N`` prometheus-client runs in multi-process mode (``PROMETHEUS_MULTIPROC_DIR``
set before it is imported): every worker's counters and histograms live in files that any
worker can merge when scraped. Live views (the router's per-rank load, engine health) are
collectors of the scraped worker, added to the merged families by name.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

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


class _Histogram:
    """One histogram series as plain numbers: counts per bucket (the last is +Inf) and sum."""

    __slots__ = ("bounds", "counts", "created", "labels", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.labels = _bucket_labels(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        # ``le`` buckets: the first bound at or above the value.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def add_to(self, family: HistogramMetricFamily, endpoint: str) -> None:
        cumulative = 0.0
        buckets: list[tuple[str, float]] = []
        for label, count in zip(self.labels, self.counts, strict=True):
            cumulative += count
            buckets.append((label, cumulative))
        family.add_metric([endpoint], buckets, self.total)
        family.samples.append(
            Sample(family.name + "_created", {"endpoint": endpoint}, self.created)
        )


def _bucket_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` values prometheus-client writes for ``bounds`` and +Inf."""
    labels: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
    return (*labels, "+Inf")


class _Endpoint:
    """What one endpoint's finished requests add up to (single-process mode)."""

    __slots__ = ("completion", "created", "inter_token", "latency", "prompt", "queue", "ttft")

    def __init__(self) -> None:
        self.latency = _Histogram(LATENCY_BUCKETS)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.inter_token = _Histogram(ITL_BUCKETS)
        self.queue = _Histogram(QUEUE_BUCKETS)
        self.prompt = 0
        self.completion = 0
        self.created = time.time()


class _Count:
    """A gauge that is only ever stepped by one, from the event loop."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class _LocalRecorder(Collector):
    """Per-request metrics as plain counters, turned into Prometheus families when scraped.

    prometheus-client takes a lock for every increment and observation (about fourteen per
    request); a single process that records from its event loop alone needs none of that.
    The families, names, labels, buckets and ``_created`` samples are those the client
    library would expose for the same metrics.
    """

    def __init__(self) -> None:
        self.in_flight = _Count()
        self.endpoints = {e: _Endpoint() for e in ENDPOINTS}
        # (endpoint, status, model) -> [count, created]
        self.requests: dict[tuple[str, str, str], list[float]] = {}
        self._bound: dict[tuple[str, int, str], list[float]] = {}

    def observe(self, done: Observation) -> None:
        key = (done.endpoint, done.status, done.model)
        counter = self._bound.get(key)
        if counter is None:
            counter = self._bind(key)
        counter[0] += 1
        series = self.endpoints[done.endpoint]
        series.latency.observe(done.total)
        if done.queue > 0.0:
            series.queue.observe(done.queue)
        if done.ttft > 0.0:
            series.ttft.observe(done.ttft)
        if done.inter_token >= 0.0:
            series.inter_token.observe(done.inter_token)
        series.prompt += done.prompt_tokens
        series.completion += done.completion_tokens

    def _bind(self, key: tuple[str, int, str]) -> list[float]:
        endpoint, status, model = key
        if len(self._bound) >= MAX_REQUEST_SERIES:
            model = "other"
        labels = (endpoint, str(status), model)
        counter = self.requests.get(labels)
        if counter is None:
            counter = self.requests[labels] = [0, time.time()]
        if len(self._bound) < 2 * MAX_REQUEST_SERIES:
            self._bound[key] = counter
        return counter

    def collect(self) -> Iterator[Metric]:
        name, doc, labels = _REQUESTS
        requests = CounterMetricFamily(name, doc, labels=labels)
        for values, (count, created) in list(self.requests.items()):
            requests.add_metric(list(values), count, created=created)
        yield requests
        endpoints = list(self.endpoints.items())
        for name, doc, attribute in _HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=["endpoint"])
            for endpoint, series in endpoints:
                getattr(series, attribute).add_to(family, endpoint)
            yield family
        for name, doc, attribute in _TOKEN_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["endpoint"])
            for endpoint, series in endpoints:
                counter.add_metric([endpoint], getattr(series, attribute), created=series.created)
            yield counter
        gauge = GaugeMetricFamily(_IN_FLIGHT[0], _IN_FLIGHT[1])
        gauge.add_metric([], float(self.in_flight.value))
        yield gauge


class _SharedRecorder:
    """Per-request metrics in prometheus-client's multi-process files (``--workers N``):
    every worker writes its own, and whichever worker is scraped merges them all."""

    def __init__(self, registry: CollectorRegistry) -> None:
        name, doc, labels = _REQUESTS
        self.requests = Counter(name, doc, labels, registry=registry)
        histograms = {
            attribute: Histogram(name, doc, ("endpoint",), registry=registry, buckets=buckets)
            for (name, doc, attribute), buckets in zip(_HISTOGRAMS, _BUCKETS, strict=True)
        }
        tokens = {
            attribute: Counter(name, doc, ("endpoint",), registry=registry)
            for name, doc, attribute in _TOKEN_COUNTERS
        }
        self.in_flight = Gauge(
            _IN_FLIGHT[0], _IN_FLIGHT[1], registry=registry, multiprocess_mode="livesum"
        )
        # Label children bound once; (status, model) pairs on first use, with a ceiling.
        self._series = {
            e: (
                histograms["latency"].labels(e),
                histograms["queue"].labels(e),
                histograms["ttft"].labels(e),
                histograms["inter_token"].labels(e),
                tokens["prompt"].labels(e),
                tokens["completion"].labels(e),
            )
            for e in ENDPOINTS
        }
        self._requests: dict[tuple[str, int, str], Counter] = {}

    def observe(self, done: Observation) -> None:
        key = (done.endpoint, done.status, done.model)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._bind(key)
        counter.inc()
        latency, queue, ttft, inter_token, prompt, completion = self._series[done.endpoint]
        latency.observe(done.total)
        if done.queue > 0.0:
            queue.observe(done.queue)
        if done.ttft > 0.0:
            ttft.observe(done.ttft)
        if done.inter_token >= 0.0:
            inter_token.observe(done.inter_token)
        if done.prompt_tokens:
            prompt.inc(done.prompt_tokens)
        if done.completion_tokens:
            completion.inc(done.completion_tokens)

    def _bind(self, key: tuple[str, int, str]) -> Counter:
        endpoint, status, model = key
        if len(self._requests) >= MAX_REQUEST_SERIES:
            model = "other"
        counter = self.requests.labels(endpoint, str(status), model)
        if len(self._requests) < 2 * MAX_REQUEST_SERIES:
            self._requests[key] = counter
        return counter


_REQUESTS = (
    "rankgate_http_requests",
    "OpenAI requests by endpoint, HTTP status and model.",
    ["endpoint", "status", "model"],
)
_HISTOGRAMS = (
    (
        "rankgate_http_request_duration_seconds",
        "Time from request to the last byte of the response.",
        "latency",
    ),
    (
        "rankgate_time_to_first_token_seconds",
        "Time from request to the engine's first token (streamed requests).",
        "ttft",
    ),
    (
        "rankgate_inter_token_latency_seconds",
        "Mean time between tokens after the first, one observation per streamed request.",
        "inter_token",
    ),
    (
        "rankgate_request_queue_seconds",
        "Time from request to the engine request being sent (decoding, admission, "
        "tokenization, routing).",
        "queue",
    ),
)
_BUCKETS = (LATENCY_BUCKETS, TTFT_BUCKETS, ITL_BUCKETS, QUEUE_BUCKETS)
_TOKEN_COUNTERS = (
    (
        "rankgate_prompt_tokens",
        "Prompt tokens of finished requests (vLLM's count, images expanded).",
        "prompt",
    ),
    ("rankgate_completion_tokens", "Tokens generated for finished requests.", "completion"),
)
_IN_FLIGHT = ("rankgate_http_requests_in_flight", "OpenAI requests being served.")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.multiproc_dir = os.environ.get(MULTIPROC_ENV) or None
        self._engine = _EngineCollector()
        recorder: _LocalRecorder | _SharedRecorder
        if self.multiproc_dir is None:
            recorder = _LocalRecorder()
            registry.register(recorder)
        else:
            recorder = _SharedRecorder(registry)
        registry.register(self._engine)
        self._recorder = recorder
        self.in_flight: _Count | Gauge = recorder.in_flight
        self.observe = recorder.observe

    def watch_engine(self, probe: EngineProbe | None) -> None:
        """Report engine health from ``probe`` (None: no engine yet)."""
        self._engine.probe = probe

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
