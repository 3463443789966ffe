"""What disaggregated serving exports: where each prefill ran and why, missed KV leases, and
how long finished prefills' KV waited for its reader.

One observation per request at most, so prometheus-client's own collectors (which also work
across ``--workers`` processes) cost nothing that matters here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Seconds: a hand-off on one host takes milliseconds; a lease is 30 s by default.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


class DisaggMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.prefills = Counter(
            "rankgate_pd_prefills",
            "Disaggregated requests by where their prompt was prefilled (remote: the prefill "
            "engine, then a KV transfer; local: the decode engine itself) and why.",
            ["where", "reason"],
            registry=registry,
        )
        self.lease_missed = Counter(
            "rankgate_pd_kv_lease_missed",
            "Decodes not answered from a prefill's KV because it may have been released "
            "before they read it (stage: still queued in the gateway, or sent and not "
            "started); each was prefilled again on the decode engine.",
            ["stage"],
            registry=registry,
        )
        self.seeded = Counter(
            "rankgate_pd_first_token_seeded",
            "Remote prefills whose sampled token the client got as its first (first_token), "
            "or as its whole answer (whole_answer: a stop or max_tokens 1); held_back: not "
            "sent early, its text ending inside a character; mismatch counts decodes whose "
            "own first token differed from it.",
            ["outcome"],
            registry=registry,
        )
        self.kv_wait = Histogram(
            "rankgate_pd_kv_wait_seconds",
            "Seconds from a prefill finishing to its decode's first token (the KV was read "
            "by then) or to the decode being given up: how long prefills' KV sat waiting for "
            "a reader (stranded KV).",
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
