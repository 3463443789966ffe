"""Reading a gateway's ``/metrics`` in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_total(http: httpx.Client, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    total = 0.0
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
