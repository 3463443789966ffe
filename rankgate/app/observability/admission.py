"""Admission as Prometheus series: each pool's slots, slots in use and waiters, read when
scraped from the engine's :class:`rankgate.sidecar.admission.Admission` (admission itself lives in
the sidecar, beside the routing it constrains)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankgate.sidecar import ADMISSION_GROUP, Admission


class AdmissionCollector(Collector):
    """``rank`` is the DP rank, or ``any`` for the ``engine`` policy's group-wide pool and for
    requests waiting for a slot on whichever rank frees one."""

    def __init__(self, source: Callable[[], Admission | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily(
            "rankgate_admission_slots",
            "Engine streams this process admits per rank (its share under --workers).",
            labels=["rank"],
        )
        in_use = GaugeMetricFamily(
            "rankgate_admission_in_use",
            "Admission slots held by this process's engine streams (or reserved for a waiter), "
            "per rank.",
            labels=["rank"],
        )
        waiting = GaugeMetricFamily(
            "rankgate_admission_waiting",
            "Requests waiting in this process for an admission slot, per rank they wait for.",
            labels=["rank"],
        )
        refused = CounterMetricFamily(
            "rankgate_admission_refused",
            "Requests refused with 429 by admission, by reason (queue_full, timeout).",
            labels=["reason"],
        )
        admission = self._source()
        if admission is not None:
            for snap in admission.snapshot():
                rank = "any" if snap.key == ADMISSION_GROUP else str(snap.key)
                if snap.key != ADMISSION_GROUP or admission.group:
                    limit.add_metric([rank], snap.limit)
                    in_use.add_metric([rank], snap.in_use)
                waiting.add_metric([rank], snap.waiting)
            refused.add_metric(["queue_full"], admission.refused_full)
            refused.add_metric(["timeout"], admission.refused_late)
        yield from (limit, in_use, waiting, refused)
