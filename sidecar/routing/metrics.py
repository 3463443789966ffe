"""Prometheus collectors of the router, one set per registry.

What every routed request adds (its count, prompt and cached tokens, the cached share) is a
:class:`RouteTally` of plain numbers (``sidecar.plain_metrics``). The rest are counters bumped
where things happen (a gap, a replay). Sizes that change on every event (index blocks,
in-flight load) are read only when scraped, through a view the active router installs, so the
hot paths pay nothing for them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from rankgate.sidecar.plain_metrics import PlainHistogram, merge_count

RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


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


class RankCounts:
    """The series one (policy, rank) adds to per routed request: ``[value, created]`` each."""

    __slots__ = ("cached", "prompt", "routed")

    def __init__(self, routed: list[float], prompt: list[float], cached: list[float]) -> None:
        self.routed = routed
        self.prompt = prompt
        self.cached = cached


class RouteTally(Collector):
    """Routed requests by policy and rank, their prompt and cached tokens by rank, and the
    cached share of each prompt, as plain numbers counted from the event loop."""

    def __init__(self) -> None:
        # (policy, rank) -> [requests, created]; rank -> [tokens, created]
        self.routed: dict[tuple[str, str], list[float]] = {}
        self.prompt: dict[str, list[float]] = {}
        self.cached: dict[str, list[float]] = {}
        self.ratio = PlainHistogram(RATIO_BUCKETS)

    def bind(self, policy: str, rank: str) -> RankCounts:
        """The series of ``(policy, rank)``, shown (at 0) from now on."""
        now = time.time()
        return RankCounts(
            self.routed.setdefault((policy, rank), [0, now]),
            self.prompt.setdefault(rank, [0, now]),
            self.cached.setdefault(rank, [0, now]),
        )

    def count(self, policy: str, rank: str) -> None:
        """One request routed by a policy that neither chose nor measured a prefix."""
        series = self.routed.get((policy, rank))
        if series is None:
            series = self.routed[(policy, rank)] = [0, time.time()]
        series[0] += 1

    def collect(self) -> Iterator[Metric]:
        routed = CounterMetricFamily(
            "rankgate_routing_requests",
            "Engine requests routed, by policy and chosen rank ('none' lets vLLM choose).",
            labels=["policy", "rank"],
        )
        # Copied first: a scrape reads these from a thread while the loop may add a series.
        for (policy, rank), (value, created) in list(self.routed.items()):
            routed.add_metric([policy, rank], value, created=created)
        yield routed
        for series, name, doc in (
            (self.prompt, "rankgate_routing_prompt_tokens", "Prompt tokens routed, by rank."),
            (
                self.cached,
                "rankgate_routing_cached_tokens",
                "Prompt tokens the chosen rank was believed to hold already, by rank.",
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["rank"])
            for rank, (value, created) in list(series.items()):
                family.add_metric([rank], value, created=created)
            yield family
        ratio = HistogramMetricFamily(
            "rankgate_routing_cached_prefix_ratio",
            "Share of each routed prompt the chosen rank was believed to hold.",
        )
        self.ratio.add_to(ratio, {})
        yield ratio

    def state(self) -> dict[str, Any]:
        return {
            "routed": [[*key, *value] for key, value in list(self.routed.items())],
            "prompt": [[rank, *value] for rank, value in list(self.prompt.items())],
            "cached": [[rank, *value] for rank, value in list(self.cached.items())],
            "ratio": self.ratio.state(),
        }

    def merge(self, state: dict[str, Any]) -> None:
        """Add another process's :meth:`state` to this one."""
        for policy, rank, value, created in state["routed"]:
            merge_count(self.routed, (policy, rank), value, created)
        for rank, value, created in state["prompt"]:
            merge_count(self.prompt, rank, value, created)
        for rank, value, created in state["cached"]:
            merge_count(self.cached, rank, value, created)
        self.ratio.merge(state["ratio"])


class RegretMetrics:
    """Predicted against realised cache hits, and per-rank trust in the KV view."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.predicted = Counter(
            "rankgate_routing_predicted_hit_tokens",
            "Prompt tokens of measured requests the router believed their rank held.",
            ["policy", "rank"],
            registry=registry,
        )
        self.realised = Counter(
            "rankgate_routing_realised_hit_tokens",
            "Prompt tokens of measured requests their rank did not compute, by its KV events.",
            ["policy", "rank"],
            registry=registry,
        )
        self.error = Counter(
            "rankgate_routing_hit_error_tokens",
            "Predicted minus realised hit tokens: believed held but computed (missed), or "
            "held though not believed (unforeseen).",
            ["policy", "rank", "direction"],
            registry=registry,
        )
        self.scored = Counter(
            "rankgate_routing_measured_requests",
            "Requests whose prediction was checked against their rank's KV events.",
            ["policy", "rank"],
            registry=registry,
        )
        self.trusted = Gauge(
            "rankgate_routing_kv_view_trusted",
            "1 while a rank is routed on its KV view; 0 while it is routed by load alone "
            "because its view is not trustworthy.",
            ["rank"],
            registry=registry,
        )
        self.distrusted = Counter(
            "rankgate_routing_kv_view_distrusted",
            "Times a rank's KV view stopped being trusted, by reason (silent, mismatch, "
            "mispredicting, gap, block_size, schema).",
            ["rank", "reason"],
            registry=registry,
        )


class RoutingMetrics:
    """All routing collectors; build with :func:`routing_metrics` to share one per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tally = RouteTally()
        registry.register(self.tally)
        self.regret = RegretMetrics(registry)
        self.spills = Counter(
            "rankgate_routing_spills",
            "Requests sent away from their best-cached rank by the hot-prefix or capacity guard.",
            ["reason"],
            registry=registry,
        )
        self.affinity = Counter(
            "rankgate_routing_affinity",
            "Requests naming a conversation the router remembered: sent where it went before "
            "(followed), or elsewhere because that rank's load outweighed it (yielded).",
            ["outcome"],
            registry=registry,
        )
        self.event_batches = Counter(
            "rankgate_kv_event_batches",
            "KV-event batches applied, by rank and origin (live or replay).",
            ["rank", "origin"],
            registry=registry,
        )
        self.event_turns = Counter(
            "rankgate_kv_event_turns",
            "Wake-ups of the KV-event thread: live batches, a replay's answer, or a deadline "
            "(a bind retry, a replay's end). An idle intake has none; under load, batches over "
            "turns is how many one wake-up serves.",
            registry=registry,
        )
        self.events = Counter(
            "rankgate_kv_events",
            "KV events applied, by rank and type.",
            ["rank", "type"],
            registry=registry,
        )
        self.event_sequence = Gauge(
            "rankgate_kv_event_sequence",
            "Sequence number of the latest KV-event batch taken in from each rank; beside the "
            "publisher's own count it shows how far the gateway's view trails the engine.",
            ["rank"],
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
        self.intake_up = Gauge(
            "rankgate_kv_intake_up",
            "1 while the KV-event intake thread serves; 0 while it restarts after a fault (the "
            "ranks' indexes are purged then, so routing falls back to load) or once stopped.",
            registry=registry,
        )
        self.intake_restarts = Counter(
            "rankgate_kv_intake_restarts",
            "Times the KV-event intake restarted after an unexpected fault.",
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
