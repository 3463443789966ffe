"""Gateway-level Prometheus metrics; label children are bound once, not per request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ENDPOINTS = ("chat", "completions")
STATUSES = ("2xx", "4xx", "5xx")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        requests = Counter(
            "rankgate_http_requests",
            "OpenAI requests by endpoint and status class",
            ("endpoint", "status"),
            registry=registry,
        )
        latency = Histogram(
            "rankgate_http_request_duration_seconds",
            "Time from request to the last byte of the response",
            ("endpoint",),
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.in_flight = Gauge(
            "rankgate_http_requests_in_flight", "OpenAI requests being served", registry=registry
        )
        self._requests = {(e, s): requests.labels(e, s) for e in ENDPOINTS for s in STATUSES}
        self._latency = {e: latency.labels(e) for e in ENDPOINTS}

    def done(self, endpoint: str, status: int, seconds: float) -> None:
        status_class = "2xx" if status < 400 else "4xx" if status < 500 else "5xx"
        self._requests[(endpoint, status_class)].inc()
        self._latency[endpoint].observe(seconds)
