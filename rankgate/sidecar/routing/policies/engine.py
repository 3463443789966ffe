"""``engine``: no rank is sent, and vLLM's own balancer chooses (the baseline that knows no
caches)."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from rankgate.sidecar.routing.base import PrefillCost, RouteDecision, RouteTicket
from rankgate.sidecar.routing.load import UntrackedTicket
from rankgate.sidecar.routing.metrics import RoutingMetrics
from rankgate.sidecar.routing.policies.ranked import prompt_tokens
from rankgate.sidecar.types import EngineInfo, PreparedRequest


class EngineRouter:
    name = "engine"

    def __init__(self, metrics: RoutingMetrics) -> None:
        self._tally = metrics.tally
        self._unpinned = metrics.tally.bind("engine", "none").routed
        self._decision = RouteDecision(rank=None, policy="engine")

    def configure(self, info: EngineInfo) -> None:
        return None

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        if request.rank is not None:
            self._tally.count("engine", str(request.rank))
            return UntrackedTicket(
                RouteDecision(rank=request.rank, policy="engine", reason="pinned")
            )
        self._unpinned[0] += 1
        return UntrackedTicket(self._decision)

    def prefill_cost(self, request: PreparedRequest) -> PrefillCost:
        """The whole prompt: this policy sees neither caches nor queues."""
        return PrefillCost(prompt_tokens(request), 0.0)

    def sent(self) -> None:
        return None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
