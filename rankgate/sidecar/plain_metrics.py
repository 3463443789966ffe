"""Prometheus series kept as plain numbers, for the paths every request takes.

prometheus-client takes a lock for every increment and observation, and in multi-process
mode writes a memory-mapped file as well. A process that counts from its event loop alone
needs neither: it adds to numbers, and a collector turns them into the families the client
library would expose (the same names, labels, ``le`` values and ``_created`` samples) when
``/metrics`` is scraped. With ``--workers`` each worker's numbers travel as :meth:`state`
and are added up with :meth:`merge` (``rankgate.app.observability.metrics``).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


def merge_count(series: dict[Any, list[float]], key: Any, value: float, created: float) -> None:
    """Add another process's ``[value, created]`` of counter ``key`` to ``series``: the
    values add up, the earliest creation stands."""
    mine = series.get(key)
    if mine is None:
        series[key] = [value, created]
    else:
        mine[0] += value
        mine[1] = min(mine[1], created)


class PlainHistogram:
    """One histogram series: counts per bucket (the last is +Inf) and their sum."""

    __slots__ = ("bounds", "counts", "created", "labels", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.labels = bucket_labels(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        # ``le`` buckets: the first bound at or above the value.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def state(self) -> list[Any]:
        return [self.counts, self.total, self.created]

    def merge(self, state: list[Any]) -> None:
        counts, total, created = state
        if len(counts) == len(self.counts):
            self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
            self.total += total
            self.created = min(self.created, created)

    def add_to(self, family: HistogramMetricFamily, labels: dict[str, str]) -> None:
        """Add this series to ``family`` under ``labels`` (in the family's label order)."""
        cumulative = 0.0
        buckets: list[tuple[str, float]] = []
        for label, count in zip(self.labels, self.counts, strict=True):
            cumulative += count
            buckets.append((label, cumulative))
        family.add_metric(list(labels.values()), buckets, self.total)
        family.samples.append(Sample(family.name + "_created", labels, self.created))


def bucket_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` values prometheus-client writes for ``bounds`` and +Inf."""
    labels: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
    return (*labels, "+Inf")
