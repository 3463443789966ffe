"""The router's per-request tally: plain numbers that expose what prometheus-client's own
objects would, and that add up across worker processes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from rankgate.sidecar.routing.metrics import AFFINITY, RATIO_BUCKETS, SPILLS, RouteTally

# (policy, rank, prompt tokens, cached tokens) of each routed request
ROUTES = [("kv", "0", 17, 16), ("kv", "1", 40, 0), ("kv", "0", 8, 8), ("kv", "1", 0, 0)]


def _outcomes(prompt: int, cached: int) -> list[tuple[str, str]]:
    """What the test counts for a route: a spill when nothing was cached, and an affinity
    followed when the prompt was cached whole, else yielded."""
    found = [(SPILLS, "capacity")] if not cached else []
    return [*found, (AFFINITY, "followed" if cached == prompt else "yielded")]


def _tally(routes: list[tuple[str, str, int, int]]) -> RouteTally:
    tally = RouteTally()
    for policy, rank, prompt, cached in routes:
        counts = tally.bind(policy, rank)
        counts.routed[0] += 1
        counts.prompt[0] += prompt
        counts.cached[0] += cached
        if prompt:
            tally.ratio.observe(cached / prompt)
        for family, outcome in _outcomes(prompt, cached):
            tally.outcome(family, outcome)[0] += 1
    tally.outcome(SPILLS, "hot_prefix")  # shown at 0
    tally.count("engine", "3")
    return tally


def _reference(routes: list[tuple[str, str, int, int]]) -> str:
    registry = CollectorRegistry()
    routed = Counter(
        "rankgate_routing_requests",
        "Engine requests routed, by policy and chosen rank ('none' lets vLLM choose).",
        ["policy", "rank"],
        registry=registry,
    )
    prompt = Counter(
        "rankgate_routing_prompt_tokens",
        "Prompt tokens routed, by rank.",
        ["rank"],
        registry=registry,
    )
    cached = Counter(
        "rankgate_routing_cached_tokens",
        "Prompt tokens the chosen rank was believed to hold already, by rank.",
        ["rank"],
        registry=registry,
    )
    ratio = Histogram(
        "rankgate_routing_cached_prefix_ratio",
        "Share of each routed prompt the chosen rank was believed to hold.",
        buckets=RATIO_BUCKETS,
        registry=registry,
    )
    outcomes = {
        SPILLS: Counter(
            "rankgate_routing_spills",
            "Requests sent away from their best-cached rank by the hot-prefix or capacity guard.",
            ["reason"],
            registry=registry,
        ),
        AFFINITY: Counter(
            "rankgate_routing_affinity",
            "Requests naming a conversation the router remembered: sent where it went before "
            "(followed), or elsewhere because that rank's load outweighed it (yielded).",
            ["outcome"],
            registry=registry,
        ),
    }
    for policy, rank, tokens, hit in routes:
        routed.labels(policy, rank).inc()
        prompt.labels(rank).inc(tokens)
        cached.labels(rank).inc(hit)
        if tokens:
            ratio.observe(hit / tokens)
        for family, outcome in _outcomes(tokens, hit):
            outcomes[family].labels(outcome).inc()
    outcomes[SPILLS].labels("hot_prefix")
    routed.labels("engine", "3").inc()
    return generate_latest(registry).decode()


def _lines(exposition: str) -> list[str]:
    """The exposition with the ``_created`` timestamps left out (their names stay)."""
    return sorted(
        line.rsplit(" ", 1)[0] if "_created" in line else line for line in exposition.splitlines()
    )


def test_the_tally_exposes_what_the_client_library_would() -> None:
    registry = CollectorRegistry()
    registry.register(_tally(ROUTES))
    assert _lines(generate_latest(registry).decode()) == _lines(_reference(ROUTES))


def test_tallies_of_several_processes_add_up() -> None:
    merged = RouteTally()
    merged.merge(_tally(ROUTES[:2]).state())
    merged.merge(_tally(ROUTES[2:]).state())
    registry = CollectorRegistry()
    registry.register(merged)
    reference = _reference(ROUTES).replace(
        'rankgate_routing_requests_total{policy="engine",rank="3"} 1.0',
        'rankgate_routing_requests_total{policy="engine",rank="3"} 2.0',
    )
    assert _lines(generate_latest(registry).decode()) == _lines(reference)
