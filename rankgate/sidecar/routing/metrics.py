"""Prometheus collectors of the router, one set per registry.

What every routed request adds (its count, prompt and cached tokens, the cached share, a spill
or an affinity outcome) is a :class:`RouteTally` of plain numbers
(``rankgate.sidecar.plain_metrics``). The rest are counters bumped where things happen (a gap, a
replay). Sizes that change on every event (index blocks, in-flight load) are read only when scraped,
through a view the active router installs, so the hot paths pay nothing for them.
"""

from __future__ import annotations

import copy
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
SPILLS = "rankgate_routing_spills"
AFFINITY = "rankgate_routing_affinity"
# The outcome counters of a routed request: family -> (help, the outcome's label).
_OUTCOMES = {
    SPILLS: (
        "Requests sent away from their best-cached rank by the hot-prefix or capacity guard.",
        "reason",
    ),
    AFFINITY: (
        "Requests naming a conversation the router remembered: sent where it went before "
        "(followed), or elsewhere because that rank's load outweighed it (yielded).",
        "outcome",
    ),
}


class RankSnapshot(msgspec.Struct, frozen=True, gc=False):
    rank: int
    device_blocks: int
    offloaded_blocks: int
    predicted_blocks: int
    in_flight: int
    prefill_tokens: int
    decode_tokens: int
    # The rank's learned speed over the median rank's, and its queued prefill at that pace.
    speed: float = 1.0
    predicted_wait: float = 0.0


class _Sided:
    """One side's handle on a collector whose last label is the side (disaggregated
    serving: the prefill engine's ranks and the decode engine's share the same ids)."""

    __slots__ = ("_family", "_side")

    def __init__(self, family: Counter | Gauge, side: str) -> None:
        self._family = family
        self._side = side

    def labels(self, *values: str) -> Any:
        return self._family.labels(*values, self._side)

    def inc(self, amount: float = 1) -> None:
        self._family.labels(self._side).inc(amount)

    def set(self, value: float) -> None:
        gauge = self._family.labels(self._side)
        assert isinstance(gauge, Gauge)
        gauge.set(value)


CounterLike = Counter | _Sided
GaugeLike = Gauge | _Sided


class _ViewCollector(Collector):
    def __init__(self, sided: bool) -> None:
        self.sided = sided
        # Each side's active router's per-rank snapshot ("" without sides).
        self.views: dict[str, Callable[[], Iterable[RankSnapshot]] | None] = {}

    def collect(self) -> Iterator[Metric]:
        side = ["side"] if self.sided else []
        index = GaugeMetricFamily(
            "rankgate_routing_index_blocks",
            "Blocks each rank holds according to its KV events, by medium.",
            labels=["rank", "medium", *side],
        )
        predicted = GaugeMetricFamily(
            "rankgate_routing_predicted_blocks",
            "Blocks each rank is predicted to hold from recent routing decisions.",
            labels=["rank", *side],
        )
        in_flight = GaugeMetricFamily(
            "rankgate_routing_in_flight_requests",
            "Requests routed to each rank and not finished yet.",
            labels=["rank", *side],
        )
        pending = GaugeMetricFamily(
            "rankgate_routing_pending_prefill_tokens",
            "Uncached prompt tokens routed to each rank that are still waiting for prefill.",
            labels=["rank", *side],
        )
        decode = GaugeMetricFamily(
            "rankgate_routing_decode_tokens",
            "Prompt tokens held by each rank's requests past their first token, each "
            "request's counted up to the routing decode-tokens cap.",
            labels=["rank", *side],
        )
        speed = GaugeMetricFamily(
            "rankgate_routing_rank_speed",
            "Each rank's speed as the router learned it from its first tokens, over the median "
            "rank's (1: alike within the band).",
            labels=["rank", *side],
        )
        wait = GaugeMetricFamily(
            "rankgate_routing_predicted_wait_seconds",
            "Seconds each rank's queued prefill takes at its learned pace (0 while unknown).",
            labels=["rank", *side],
        )
        for name, view in list(self.views.items()):
            tail = [name] if self.sided else []
            for snap in view() if view is not None else ():
                rank = str(snap.rank)
                index.add_metric([rank, "device", *tail], snap.device_blocks)
                index.add_metric([rank, "offloaded", *tail], snap.offloaded_blocks)
                predicted.add_metric([rank, *tail], snap.predicted_blocks)
                in_flight.add_metric([rank, *tail], snap.in_flight)
                pending.add_metric([rank, *tail], snap.prefill_tokens)
                decode.add_metric([rank, *tail], snap.decode_tokens)
                speed.add_metric([rank, *tail], snap.speed)
                wait.add_metric([rank, *tail], snap.predicted_wait)
        yield from (index, predicted, in_flight, pending, decode, speed, wait)


class RankCounts:
    """The series one (policy, rank) adds to per routed request: ``[value, created]`` each."""

    __slots__ = ("cached", "prompt", "routed")

    def __init__(self, routed: list[float], prompt: list[float], cached: list[float]) -> None:
        self.routed = routed
        self.prompt = prompt
        self.cached = cached


class RouteTally(Collector):
    """Routed requests by policy and rank, their prompt and cached tokens by rank, and the
    cached share of each prompt, as plain numbers counted from the event loop.

    With ``sided`` (disaggregated serving) every series also carries the side; each side's
    router counts through its own handle (:meth:`for_side`) on the same numbers.
    """

    def __init__(self, sided: bool = False) -> None:
        self.sided = sided
        self.side = ""
        # (side, policy, rank) -> [requests, created]; (side, rank) -> [tokens, created]
        self.routed: dict[tuple[str, str, str], list[float]] = {}
        self.prompt: dict[tuple[str, str], list[float]] = {}
        self.cached: dict[tuple[str, str], list[float]] = {}
        # (family, side, outcome) -> [requests, created]
        self.outcomes: dict[tuple[str, str, str], list[float]] = {}
        self.ratios: dict[str, PlainHistogram] = {"": PlainHistogram(RATIO_BUCKETS)}

    def for_side(self, side: str) -> RouteTally:
        """A handle counting as ``side`` into the same numbers."""
        handle = copy.copy(self)
        handle.side = side
        self.ratios.setdefault(side, PlainHistogram(RATIO_BUCKETS))
        return handle

    @property
    def ratio(self) -> PlainHistogram:
        return self.ratios[self.side]

    def bind(self, policy: str, rank: str) -> RankCounts:
        """The series of ``(policy, rank)``, shown (at 0) from now on."""
        now = time.time()
        side = self.side
        return RankCounts(
            self.routed.setdefault((side, policy, rank), [0, now]),
            self.prompt.setdefault((side, rank), [0, now]),
            self.cached.setdefault((side, rank), [0, now]),
        )

    def outcome(self, family: str, value: str) -> list[float]:
        """The ``[requests, created]`` of one outcome series of ``family`` (a spill's reason,
        an affinity's outcome), shown (at 0) from now on: its owner adds to ``[0]``."""
        return self.outcomes.setdefault((family, self.side, value), [0, time.time()])

    def count(self, policy: str, rank: str) -> None:
        """One request routed by a policy that neither chose nor measured a prefix."""
        key = (self.side, policy, rank)
        series = self.routed.get(key)
        if series is None:
            series = self.routed[key] = [0, time.time()]
        series[0] += 1

    def collect(self) -> Iterator[Metric]:
        side = ["side"] if self.sided else []
        routed = CounterMetricFamily(
            "rankgate_routing_requests",
            "Engine requests routed, by policy and chosen rank ('none' lets vLLM choose).",
            labels=["policy", "rank", *side],
        )
        # Copied first: a scrape reads these from a thread while the loop may add a series.
        for (where, policy, rank), (value, created) in list(self.routed.items()):
            routed.add_metric([policy, rank, *self._tail(where)], value, created=created)
        yield routed
        for series, name, doc in (
            (self.prompt, "rankgate_routing_prompt_tokens", "Prompt tokens routed, by rank."),
            (
                self.cached,
                "rankgate_routing_cached_tokens",
                "Prompt tokens the chosen rank was believed to hold already, by rank.",
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["rank", *side])
            for (where, rank), (value, created) in list(series.items()):
                family.add_metric([rank, *self._tail(where)], value, created=created)
            yield family
        outcomes = list(self.outcomes.items())
        for name, (doc, label) in _OUTCOMES.items():
            family = CounterMetricFamily(name, doc, labels=[label, *side])
            for (of, where, outcome), (count, created) in outcomes:
                if of == name:
                    family.add_metric([outcome, *self._tail(where)], count, created=created)
            yield family
        ratio = HistogramMetricFamily(
            "rankgate_routing_cached_prefix_ratio",
            "Share of each routed prompt the chosen rank was believed to hold.",
            labels=side,
        )
        for where, histogram in list(self.ratios.items()):
            if self.sided and not where:
                continue
            histogram.add_to(ratio, {"side": where} if self.sided else {})
        yield ratio

    def _tail(self, side: str) -> list[str]:
        return [side] if self.sided else []

    def state(self) -> dict[str, Any]:
        return {
            "routed": [[*key, *value] for key, value in list(self.routed.items())],
            "prompt": [[*key, *value] for key, value in list(self.prompt.items())],
            "cached": [[*key, *value] for key, value in list(self.cached.items())],
            "outcomes": [[*key, *value] for key, value in list(self.outcomes.items())],
            "ratio": {side: h.state() for side, h in list(self.ratios.items())},
        }

    def merge(self, state: dict[str, Any]) -> None:
        """Add another process's :meth:`state` to this one (sided if it is)."""
        for side, policy, rank, value, created in state["routed"]:
            merge_count(self.routed, (side, policy, rank), value, created)
            self.sided = self.sided or bool(side)
        for side, rank, value, created in state["prompt"]:
            merge_count(self.prompt, (side, rank), value, created)
        for side, rank, value, created in state["cached"]:
            merge_count(self.cached, (side, rank), value, created)
        for family, side, outcome, value, created in state["outcomes"]:
            merge_count(self.outcomes, (family, side, outcome), value, created)
        for side, histogram in state["ratio"].items():
            self.ratios.setdefault(side, PlainHistogram(RATIO_BUCKETS)).merge(histogram)
            self.sided = self.sided or bool(side)


class RegretMetrics:
    """Predicted against realised cache hits, and per-rank trust in the KV view."""

    FAMILIES = ("predicted", "realised", "error", "scored", "trusted", "distrusted")

    def __init__(self, registry: CollectorRegistry, sided: bool = False) -> None:
        side = ["side"] if sided else []
        self.predicted: CounterLike = Counter(
            "rankgate_routing_predicted_hit_tokens",
            "Prompt tokens of measured requests the router believed their rank held.",
            ["policy", "rank", *side],
            registry=registry,
        )
        self.realised: CounterLike = Counter(
            "rankgate_routing_realised_hit_tokens",
            "Prompt tokens of measured requests their rank did not compute, by its KV events.",
            ["policy", "rank", *side],
            registry=registry,
        )
        self.error: CounterLike = Counter(
            "rankgate_routing_hit_error_tokens",
            "Predicted minus realised hit tokens: believed held but computed (missed), or "
            "held though not believed (unforeseen).",
            ["policy", "rank", "direction", *side],
            registry=registry,
        )
        self.scored: CounterLike = Counter(
            "rankgate_routing_measured_requests",
            "Requests whose prediction was checked against their rank's KV events.",
            ["policy", "rank", *side],
            registry=registry,
        )
        self.trusted: GaugeLike = Gauge(
            "rankgate_routing_kv_view_trusted",
            "1 while a rank is routed on its KV view; 0 while it is routed by load alone "
            "because its view is not trustworthy.",
            ["rank", *side],
            registry=registry,
        )
        self.distrusted: CounterLike = Counter(
            "rankgate_routing_kv_view_distrusted",
            "Times a rank's KV view stopped being trusted, by reason (silent, mismatch, "
            "mispredicting, gap, block_size, schema).",
            ["rank", "reason", *side],
            registry=registry,
        )


class RoutingMetrics:
    """All routing collectors; build with :func:`routing_metrics` to share one per registry."""

    FAMILIES = (
        "event_batches", "event_turns", "events", "event_sequence",
        "event_lag", "gaps", "replays", "purges", "rejected", "intake_up", "intake_restarts",
    )  # fmt: skip

    def __init__(self, registry: CollectorRegistry, sided: bool = False) -> None:
        self.sided = sided
        self.side = ""
        side = ["side"] if sided else []
        self.tally = RouteTally(sided)
        registry.register(self.tally)
        self.regret = RegretMetrics(registry, sided)
        self.event_batches: CounterLike = Counter(
            "rankgate_kv_event_batches",
            "KV-event batches applied, by rank and origin (live or replay).",
            ["rank", "origin", *side],
            registry=registry,
        )
        self.event_turns: CounterLike = Counter(
            "rankgate_kv_event_turns",
            "Wake-ups of the KV-event thread: live batches, a replay's answer, or a deadline "
            "(a bind retry, a replay's end). An idle intake has none; under load, batches over "
            "turns is how many one wake-up serves.",
            side,
            registry=registry,
        )
        self.events: CounterLike = Counter(
            "rankgate_kv_events",
            "KV events applied, by rank and type.",
            ["rank", "type", *side],
            registry=registry,
        )
        self.event_sequence: GaugeLike = Gauge(
            "rankgate_kv_event_sequence",
            "Sequence number of the latest KV-event batch taken in from each rank; beside the "
            "publisher's own count it shows how far the gateway's view trails the engine.",
            ["rank", *side],
            registry=registry,
        )
        self.event_lag: GaugeLike = Gauge(
            "rankgate_kv_event_lag_seconds",
            "Receive time minus publish time of each rank's latest KV-event batch.",
            ["rank", *side],
            registry=registry,
        )
        self.gaps: CounterLike = Counter(
            "rankgate_kv_event_gaps",
            "Sequence gaps seen in each rank's KV-event stream.",
            ["rank", *side],
            registry=registry,
        )
        self.replays: CounterLike = Counter(
            "rankgate_kv_event_replays",
            "Replay requests, by rank and outcome (complete, incomplete, timeout, overflow, sync).",
            ["rank", "outcome", *side],
            registry=registry,
        )
        self.purges: CounterLike = Counter(
            "rankgate_kv_event_purges",
            "Per-rank index purges, by reason (gap, restart, replay).",
            ["rank", "reason", *side],
            registry=registry,
        )
        self.rejected: CounterLike = Counter(
            "rankgate_kv_event_rejected",
            "KV-event batches or events that could not be used, by rank and reason.",
            ["rank", "reason", *side],
            registry=registry,
        )
        self.intake_up: GaugeLike = Gauge(
            "rankgate_kv_intake_up",
            "1 while the KV-event intake thread serves; 0 while it restarts after a fault (the "
            "ranks' indexes are purged then, so routing falls back to load) or once stopped.",
            side,
            registry=registry,
        )
        self.intake_restarts: CounterLike = Counter(
            "rankgate_kv_intake_restarts",
            "Times the KV-event intake restarted after an unexpected fault.",
            side,
            registry=registry,
        )
        self._view = _ViewCollector(sided)
        registry.register(self._view)

    def for_side(self, side: str) -> RoutingMetrics:
        """The collectors as one side's router counts into them (built ``sided``)."""
        if not self.sided:
            raise ValueError("these routing metrics were not built with a side label")
        handle = copy.copy(self)
        handle.side = side
        for name in self.FAMILIES:
            setattr(handle, name, _Sided(getattr(self, name), side))
        handle.tally = self.tally.for_side(side)
        regret = copy.copy(self.regret)
        for name in RegretMetrics.FAMILIES:
            setattr(regret, name, _Sided(getattr(self.regret, name), side))
        handle.regret = regret
        return handle

    def set_view(self, view: Callable[[], Iterable[RankSnapshot]] | None) -> None:
        """Install the active router's per-rank snapshot (the latest router of a side wins)."""
        self._view.views[self.side] = view


_lock = threading.Lock()
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, RoutingMetrics] = (
    weakref.WeakKeyDictionary()
)


def routing_metrics(
    registry: CollectorRegistry | None = None, sided: bool = False
) -> RoutingMetrics:
    """The routing collectors of ``registry`` (default: prometheus-client's), built once;
    ``sided`` (at the first call) labels every series with the side of a disaggregated pair."""
    target = REGISTRY if registry is None else registry
    with _lock:
        metrics = _by_registry.get(target)
        if metrics is None:
            metrics = RoutingMetrics(target, sided)
            _by_registry[target] = metrics
        return metrics
