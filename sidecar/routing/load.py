"""The gateway's own view of each rank's load: what it sent there and has not seen finish.

Per slot: requests in flight, prompt tokens still to prefill (the uncached part of prompts that
have no first token yet) and tokens held by requests past prefill. Every number changes only
through a :class:`LoadTicket`, whose transitions are idempotent, so a request that fails,
is cancelled or finishes twice can never leave the view skewed.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.routing.base import RouteDecision


class LoadTracker:
    __slots__ = ("decode_tokens", "in_flight", "max_running", "prefill_tokens", "slots")

    def __init__(self, max_running: Sequence[int]) -> None:
        self.slots = len(max_running)
        self.max_running = [max(1, m) for m in max_running]
        self.in_flight = [0] * self.slots
        self.prefill_tokens = [0] * self.slots
        self.decode_tokens = [0] * self.slots

    def admit(
        self, slot: int, decision: RouteDecision, prefill_tokens: int, total_tokens: int
    ) -> LoadTicket:
        self.in_flight[slot] += 1
        self.prefill_tokens[slot] += prefill_tokens
        return LoadTicket(self, slot, decision, prefill_tokens, total_tokens)

    def has_room(self, slot: int) -> bool:
        return self.in_flight[slot] < self.max_running[slot]


class LoadTicket:
    """One request's footprint; :meth:`first_token` and :meth:`finished` act at most once."""

    __slots__ = ("_decision", "_prefill", "_slot", "_state", "_total", "_tracker")

    _PREFILL, _DECODE, _DONE = 0, 1, 2

    def __init__(
        self,
        tracker: LoadTracker,
        slot: int,
        decision: RouteDecision,
        prefill_tokens: int,
        total_tokens: int,
    ) -> None:
        self._tracker = tracker
        self._slot = slot
        self._decision = decision
        self._prefill = prefill_tokens
        self._total = total_tokens
        self._state = self._PREFILL

    @property
    def decision(self) -> RouteDecision:
        return self._decision

    def first_token(self) -> None:
        if self._state != self._PREFILL:
            return
        self._state = self._DECODE
        tracker = self._tracker
        tracker.prefill_tokens[self._slot] = max(
            0, tracker.prefill_tokens[self._slot] - self._prefill
        )
        tracker.decode_tokens[self._slot] += self._total

    def finished(self) -> None:
        if self._state == self._DONE:
            return
        tracker = self._tracker
        slot = self._slot
        if self._state == self._PREFILL:
            tracker.prefill_tokens[slot] = max(0, tracker.prefill_tokens[slot] - self._prefill)
        else:
            tracker.decode_tokens[slot] = max(0, tracker.decode_tokens[slot] - self._total)
        tracker.in_flight[slot] = max(0, tracker.in_flight[slot] - 1)
        self._state = self._DONE


class UntrackedTicket:
    """The ticket of a request the router does not count (``engine`` policy, unknown rank)."""

    __slots__ = ("_decision",)

    def __init__(self, decision: RouteDecision) -> None:
        self._decision = decision

    @property
    def decision(self) -> RouteDecision:
        return self._decision

    def first_token(self) -> None:
        return None

    def finished(self) -> None:
        return None
