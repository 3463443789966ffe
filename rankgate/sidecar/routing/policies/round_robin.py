"""``round_robin``: each rank in turn, blind to load and caches (a baseline)."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from rankgate.sidecar.routing.base import RouteTicket
from rankgate.sidecar.routing.policies.ranked import RankedRouter, estimated, prompt_tokens
from rankgate.sidecar.types import PreparedRequest


class RoundRobinRouter(RankedRouter):
    name = "round_robin"

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        topology = self._require_topology()
        slot = self._pinned_slot(request)
        reason = "pinned"
        if slot is None:
            count = len(topology.ranks)
            slot = self._rotation % count
            self._rotation += 1
            if full and len(full) < count:
                while topology.ranks[slot] in full:
                    slot = self._rotation % count
                    self._rotation += 1
            reason = "turn"
        return self._admit(slot, prompt_tokens(request), 0, reason, estimated=estimated(request))
