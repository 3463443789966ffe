"""``load``: the cheapest rank by the ``kv`` cost with no cache knowledge (a baseline)."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from rankgate.sidecar.routing.base import RouteTicket
from rankgate.sidecar.routing.policies.ranked import RankedRouter, estimated, prompt_tokens
from rankgate.sidecar.types import PreparedRequest


class LoadRouter(RankedRouter):
    name = "load"

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        self._require_topology()
        self.load.sync()
        tokens = prompt_tokens(request)
        slot = self._pinned_slot(request)
        if slot is not None:
            return self._admit(slot, tokens, 0, "pinned", estimated=estimated(request))
        load = self.load
        wp, wd = self.config.prefill_weight, self.config.decode_weight
        best: list[int] = []
        best_cost = 0.0
        for candidate in self._with_room(full):
            cost = wp * load.prefill_tokens[candidate] + wd * load.decode_tokens[candidate]
            cost += load.in_flight[candidate] * 1e-6
            if not best or cost < best_cost:
                best, best_cost = [candidate], cost
            elif cost == best_cost:
                best.append(candidate)
        return self._admit(
            self._rotate(best), tokens, 0, "least_loaded", estimated=estimated(request)
        )
