"""The routers the rank simulation plays: Rankgate's ``kv`` and the peers it is measured
against, vllm-router's ``kv_aware`` rule and round robin, each built on the simulation's clock."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet

from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.metrics import routing_metrics
from rankgate.sidecar.routing.policies.kv import KvRouter
from rankgate.sidecar.routing.policies.ranked import RankedRouter
from rankgate.sidecar.routing.policies.round_robin import RoundRobinRouter

RouterFactory = Callable[[RoutingConfig, Callable[[], float]], RankedRouter]


def kv_router(config: RoutingConfig, clock: Callable[[], float]) -> RankedRouter:
    return KvRouter(config, routing_metrics(CollectorRegistry()), clock)


def _round_robin(config: RoutingConfig, clock: Callable[[], float]) -> RankedRouter:
    return RoundRobinRouter(config, routing_metrics(CollectorRegistry()), clock)


class LongestPrefixRouter(KvRouter):
    """vllm-router's ``kv_aware`` choice, for comparison: the rank with the longest cached
    prefix (the last of equals), the least loaded one when no rank has any, and no other
    regard for load."""

    name = "longest_prefix"

    def _choose(
        self,
        cached: list[int],
        prompt_tokens: int,
        hashes: list[int],
        full: AbstractSet[int] = frozenset(),
    ) -> tuple[int, str]:
        best = max(cached)
        if best == 0:
            in_flight = self.load.in_flight
            return min(range(len(cached)), key=in_flight.__getitem__), "least_loaded"
        return max(slot for slot, tokens in enumerate(cached) if tokens == best), "best"


def _longest_prefix(config: RoutingConfig, clock: Callable[[], float]) -> RankedRouter:
    return LongestPrefixRouter(config, routing_metrics(CollectorRegistry()), clock)


FACTORIES: dict[str, RouterFactory] = {
    "kv": kv_router,
    "round_robin": _round_robin,
    "longest_prefix": _longest_prefix,
}
