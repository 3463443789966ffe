"""Tiny routers for the sidecar tests: a fixed rank (or none), recording every ticket."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from rankgate.sidecar.routing.base import PrefillCost, RouteDecision
from rankgate.sidecar.types import EngineInfo, PreparedRequest


@dataclass
class Ticket:
    decision: RouteDecision
    first_tokens: int = 0
    finishes: int = 0

    def first_token(self) -> None:
        self.first_tokens += 1

    def finished(self) -> None:
        self.finishes += 1


@dataclass
class FixedRouter:
    """Routes every request to ``rank`` (None: no rank metadata)."""

    rank: int | None = None
    configured: list[EngineInfo] = field(default_factory=list)
    tickets: list[Ticket] = field(default_factory=list)
    started: bool = False
    closed: bool = False

    @property
    def name(self) -> str:
        return "fixed"

    def configure(self, info: EngineInfo) -> None:
        self.configured.append(info)

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> Ticket:
        ticket = Ticket(RouteDecision(rank=self.rank, policy="fixed"))
        self.tickets.append(ticket)
        return ticket

    def prefill_cost(self, request: PreparedRequest) -> PrefillCost:
        return PrefillCost(len(request.prompt_token_ids), 0.0)

    def sent(self) -> None:
        return None

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True
