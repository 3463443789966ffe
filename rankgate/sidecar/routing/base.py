"""The contract between the sidecar's generation path and a routing policy.

The sidecar asks :meth:`Router.route` once per engine request, pins the returned rank with
``x-data-parallel-rank`` (or sends none when ``rank`` is None), and reports the request's life
through the returned :class:`RouteTicket` so the router's load view stays exact.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Protocol

import msgspec

from rankgate.sidecar.types import EngineInfo, PreparedRequest


class RouteDecision(msgspec.Struct, frozen=True, kw_only=True):
    # None: send no rank metadata and let vLLM's own balancer choose.
    rank: int | None
    # Prompt tokens the chosen rank is believed to hold already (0 when unknown).
    cached_tokens: int = 0
    prompt_tokens: int = 0
    policy: str = ""
    # Why this rank: "best", "pinned", "spill_hot", "spill_capacity", "turn", "least_loaded".
    reason: str = ""
    # ``prompt_tokens`` counts an image of not yet known size as one token.
    estimated: bool = False
    # The chosen rank's learned speed over the median rank's, and the seconds its queued
    # prefill was predicted to take at that pace (0: not known).
    speed: float = 1.0
    wait: float = 0.0

    def header(self) -> str:
        """The decision as one response-header value, e.g. ``rank=2;cached=512/640;policy=kv``,
        with ``;prompt=estimated`` when an image's expanded size was not known yet, and what
        the router saw of the rank: ``;speed=0.40`` when it is learned to be slower or faster
        than the others, ``;wait_ms=37`` when prefill was queued there."""
        rank = "none" if self.rank is None else str(self.rank)
        value = (
            f"rank={rank};cached={self.cached_tokens}/{self.prompt_tokens};"
            f"policy={self.policy};reason={self.reason}"
        )
        if self.speed != 1.0:
            value += f";speed={self.speed:.2f}"
        if self.wait > 0.0:
            value += f";wait_ms={self.wait * 1e3:.0f}"
        return value + ";prompt=estimated" if self.estimated else value


class PrefillCost(msgspec.Struct, frozen=True):
    """What prefilling a prompt would cost on the rank best placed for it: the prompt tokens
    it would still compute, and the work already there in prompt tokens as the route weighs
    it (queued prefill and running decodes)."""

    uncached: int
    load: float


class RouteTicket(Protocol):
    """One engine request's footprint on the router's load view; every method is idempotent."""

    @property
    def decision(self) -> RouteDecision: ...

    def first_token(self) -> None:
        """Prefill is done: the request now costs decode, not prefill."""

    def finished(self) -> None:
        """The request left the engine (finished, failed or cancelled)."""


class Router(Protocol):
    @property
    def name(self) -> str: ...

    def configure(self, info: EngineInfo) -> None:
        """(Re)build per-rank state for a freshly discovered engine."""

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        """Choose the rank for choice ``choice`` of ``request`` and count it as in flight.

        ``full`` names the ranks with no admission slot left: a request the client did not
        pin goes to one of the others while any is left.
        """

    def prefill_cost(self, request: PreparedRequest) -> PrefillCost:
        """What prefilling ``request`` here would cost now; changes nothing (a disaggregated
        gateway weighs both engines before it routes on one)."""

    def sent(self) -> None:
        """The request last routed is on its way to the engine: bookkeeping the route put off
        to keep it off the request's path can be done now."""

    async def start(self) -> None:
        """Start background work (KV-event subscribers); a no-op for simple policies."""

    async def close(self) -> None: ...
