"""Prometheus collectors of the router, one set per registry.

Counters are bumped where things happen (a route, a gap, a replay); sizes that change on every
event (index blocks, in-flight load) are read only when scraped, through a view the active
router installs, so the hot paths pay nothing for them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator

import msgspec
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class RankSnapshot(msgspec.Struct, frozen=True, gc=False):
    rank: int
    device_blocks: int
    offloaded_blocks: int
    predicted_blocks: int
    in_flight: int
    prefill_tokens: int
    decode_tokens: int


class _ViewCollector(Collector):
    def __init__(self) -> None:
        self.view: Callable[[], Iterable[RankSnapshot]] | None = None

    def collect(self) -> Iterator[Metric]:
        index = GaugeMetricFamily(
            "rankgate_routing_index_blocks",
            "Blocks each rank holds according to its KV events, by medium.",
            labels=["rank", "medium"],
        )
        predicted = GaugeMetricFamily(
            "rankgate_routing_predicted_blocks",
            "Blocks each rank is predicted to hold from recent routing decisions.",
            labels=["rank"],
        )
        in_flight = GaugeMetricFamily(
            "rankgate_routing_in_flight_requests",
            "Requests routed to each rank and not finished yet.",
            labels=["rank"],
        )
        pending = GaugeMetricFamily(
            "rankgate_routing_pending_prefill_tokens",
            "Uncached prompt tokens routed to each rank that are still waiting for prefill.",
            labels=["rank"],
        )
        decode = GaugeMetricFamily(
            "rankgate_routing_decode_tokens",
            "Prompt tokens held by each rank's requests past their first token.",
            labels=["rank"],
        )
        view = self.view
        for snap in view() if view is not None else ():
            rank = str(snap.rank)
            index.add_metric([rank, "device"], snap.device_blocks)
            index.add_metric([rank, "offloaded"], snap.offloaded_blocks)
            predicted.add_metric([rank], snap.predicted_blocks)
            in_flight.add_metric([rank], snap.in_flight)
            pending.add_metric([rank], snap.prefill_tokens)
            decode.add_metric([rank], snap.decode_tokens)
        yield from (index, predicted, in_flight, pending, decode)


class RoutingMetrics:
    """All routing collectors; build with :func:`routing_metrics` to share one per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.routed = Counter(
            "rankgate_routing_requests",
            "Engine requests routed, by policy and chosen rank ('none' lets vLLM choose).",
            ["policy", "rank"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "rankgate_routing_prompt_tokens",
            "Prompt tokens routed, by rank.",
            ["rank"],
            registry=registry,
        )
        self.cached_tokens = Counter(
            "rankgate_routing_cached_tokens",
            "Prompt tokens the chosen rank was believed to hold already, by rank.",
            ["rank"],
            registry=registry,
        )
        self.cached_ratio = Histogram(
            "rankgate_routing_cached_prefix_ratio",
            "Share of each routed prompt the chosen rank was believed to hold.",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
            registry=registry,
        )
        self.spills = Counter(
            "rankgate_routing_spills",
            "Requests sent away from their best-cached rank by the hot-prefix or capacity guard.",
            ["reason"],
            registry=registry,
        )
        self.event_batches = Counter(
            "rankgate_kv_event_batches",
            "KV-event batches applied, by rank and origin (live or replay).",
            ["rank", "origin"],
            registry=registry,
        )
        self.events = Counter(
            "rankgate_kv_events",
            "KV events applied, by rank and type.",
            ["rank", "type"],
            registry=registry,
        )
        self.event_lag = Gauge(
            "rankgate_kv_event_lag_seconds",
            "Receive time minus publish time of each rank's latest KV-event batch.",
            ["rank"],
            registry=registry,
        )
        self.gaps = Counter(
            "rankgate_kv_event_gaps",
            "Sequence gaps seen in each rank's KV-event stream.",
            ["rank"],
            registry=registry,
        )
        self.replays = Counter(
            "rankgate_kv_event_replays",
            "Replay requests, by rank and outcome (complete, incomplete, timeout, overflow, sync).",
            ["rank", "outcome"],
            registry=registry,
        )
        self.purges = Counter(
            "rankgate_kv_event_purges",
            "Per-rank index purges, by reason (gap, restart, replay).",
            ["rank", "reason"],
            registry=registry,
        )
        self.rejected = Counter(
            "rankgate_kv_event_rejected",
            "KV-event batches or events that could not be used, by rank and reason.",
            ["rank", "reason"],
            registry=registry,
        )
        self._view = _ViewCollector()
        registry.register(self._view)

    def set_view(self, view: Callable[[], Iterable[RankSnapshot]] | None) -> None:
        """Install the active router's per-rank snapshot (the latest router wins)."""
        self._view.view = view


_lock = threading.Lock()
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, RoutingMetrics] = (
    weakref.WeakKeyDictionary()
)


def routing_metrics(registry: CollectorRegistry | None = None) -> RoutingMetrics:
    """The routing collectors of ``registry`` (default: prometheus-client's), built once."""
    target = REGISTRY if registry is None else registry
    with _lock:
        metrics = _by_registry.get(target)
        if metrics is None:
            metrics = RoutingMetrics(target)
            _by_registry[target] = metrics
        return metrics
