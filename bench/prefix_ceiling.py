"""Ground truth for routing benches: vLLM's own prefix-cache counters, and the best hit rate
any router could reach on a workload.

The counters come from vLLM's Prometheus ``/metrics`` (``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits``, summed over every engine); a run's hit rate is the difference of
two scrapes, so nothing else the server did before counts.

The ceiling replays the prompts in the order they were sent through one cache that forgets
nothing: a prompt hits every full block whose whole prefix an earlier prompt carried, except
that vLLM always computes the last prompt token (so a fully cached prompt still misses its last
block). No placement of prompts on ranks can do better; a router's distance from it is what
routing lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx

QUERIES = "vllm:prefix_cache_queries"
HITS = "vllm:prefix_cache_hits"
TTFT = "vllm:time_to_first_token_seconds"


@dataclass(frozen=True)
class CacheCounters:
    """Prompt tokens vLLM looked up in its prefix cache, and how many it found; with the
    lookups of each engine (in engine-label order) when the source tells them apart."""

    queries: float = 0.0
    hits: float = 0.0
    by_engine: tuple[float, ...] = ()
    # vLLM's own time to first token (arrival in the engine to first token), summed.
    ttft_seconds: float = 0.0
    ttft_count: float = 0.0

    def __sub__(self, before: CacheCounters) -> CacheCounters:
        return CacheCounters(
            self.queries - before.queries,
            self.hits - before.hits,
            _pairwise(self.by_engine, before.by_engine, -1.0),
            self.ttft_seconds - before.ttft_seconds,
            self.ttft_count - before.ttft_count,
        )

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(
            self.queries + other.queries,
            self.hits + other.hits,
            _pairwise(self.by_engine, other.by_engine, 1.0),
            self.ttft_seconds + other.ttft_seconds,
            self.ttft_count + other.ttft_count,
        )

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    @property
    def engine_ttft(self) -> float | None:
        """Mean seconds from a request's arrival in vLLM to its first token, as vLLM counts."""
        return self.ttft_seconds / self.ttft_count if self.ttft_count > 0 else None

    @property
    def busiest_share(self) -> float | None:
        """The largest engine's share of the prompt tokens (1/DP is perfectly even)."""
        total = sum(self.by_engine)
        return max(self.by_engine) / total if self.by_engine and total > 0 else None


def _pairwise(a: tuple[float, ...], b: tuple[float, ...], sign: float) -> tuple[float, ...]:
    if len(a) != len(b):
        return ()
    return tuple(x + sign * y for x, y in zip(a, b, strict=True))


def parse_counters(exposition: str) -> CacheCounters:
    """Sum each counter over all its label sets (one per engine / DP rank).

    Read line by line: metric names with a colon are legal in the text format but not every
    parser takes them, and only a few sample names matter here.
    """
    ttft = {TTFT + "_sum": 0.0, TTFT + "_count": 0.0}
    totals: dict[str, float] = {}
    engines: dict[str, float] = {}
    for line in exposition.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ttft:
            ttft[name] += float(line.rsplit(" ", 1)[1])
            continue
        family = name.removesuffix("_total")
        if family not in (QUERIES, HITS):
            continue
        value = float(line.rsplit(" ", 1)[1])
        totals[family] = totals.get(family, 0.0) + value
        if family == QUERIES:
            engine = _label(line, "engine")
            engines[engine] = engines.get(engine, 0.0) + value
    missing = {QUERIES, HITS} - set(totals)
    if missing:
        raise ValueError(f"vLLM's /metrics has no {', '.join(sorted(missing))}")
    by_engine = tuple(engines[e] for e in sorted(engines))
    return CacheCounters(
        totals[QUERIES], totals[HITS], by_engine, ttft[TTFT + "_sum"], ttft[TTFT + "_count"]
    )


def _label(line: str, key: str) -> str:
    marker = f'{key}="'
    at = line.find(marker)
    if at < 0:
        return ""
    start = at + len(marker)
    return line[start : line.index('"', start)]


async def read_counters(http: httpx.AsyncClient, base_url: str) -> CacheCounters:
    response = await http.get(f"{base_url}/metrics")
    response.raise_for_status()
    return parse_counters(response.text)


def ceiling(prompts: Iterable[Sequence[int]], block_size: int) -> CacheCounters:
    """Hits a single never-evicting cache would score on ``prompts`` in this order."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    cached: set[int] = set()
    queries = hits = 0
    for prompt in prompts:
        queries += len(prompt)
        limit = (len(prompt) - 1) // block_size
        parent = 0
        matching = True
        for index in range(len(prompt) // block_size):
            start = index * block_size
            key = hash((parent, tuple(prompt[start : start + block_size])))
            if matching and index < limit and key in cached:
                hits += block_size
            else:
                matching = False
            cached.add(key)
            parent = key
    return CacheCounters(float(queries), float(hits))
