"""The gateway's own view of each rank's load: what it sent there and has not seen finish.

Per slot: requests in flight, prompt tokens still to prefill (the uncached part of prompts that
have no first token yet) and tokens held by requests past prefill. Every number changes only
through a :class:`LoadTicket`, whose transitions are idempotent, so a request that fails,
is cancelled or finishes twice can never leave the view skewed.

With several worker processes the view also holds the other workers' counts, read from a
:class:`~rankgate.sidecar.routing.shared_load.SharedLoadBoard` by :meth:`LoadTracker.sync` before
each decision; this process's own changes are written to its row of the board as they happen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from rankgate.sidecar.routing.base import RouteDecision
from rankgate.sidecar.routing.shared_load import SharedLoadBoard


class LoadTracker:
    __slots__ = (
        "_fresh",
        "_others",
        "decode_tokens",
        "in_flight",
        "max_running",
        "pace",
        "prefill_tokens",
        "ranks",
        "shared",
        "slots",
    )

    def __init__(
        self,
        max_running: Sequence[int],
        shared: SharedLoadBoard | None = None,
        ranks: Sequence[int] = (),
    ) -> None:
        self.slots = len(max_running)
        self.max_running = [max(1, m) for m in max_running]
        self.in_flight = [0] * self.slots
        self.prefill_tokens = [0] * self.slots
        self.decode_tokens = [0] * self.slots
        # The DP rank of each slot, which keys the shared board.
        self.ranks = tuple(ranks) if ranks else tuple(range(self.slots))
        if len(self.ranks) != self.slots:
            raise ValueError("one rank per slot is needed to share load")
        self.shared = shared
        self._others = [[0] * self.slots for _ in range(3)]
        self._fresh = [[0] * self.slots for _ in range(3)]
        # Learns each rank's speed from its first tokens (None: every rank counts as alike).
        self.pace: RankPace | None = None

    def sync(self) -> None:
        """Replace the other workers' part of the view with their current counts."""
        shared = self.shared
        if shared is None:
            return
        fresh, old = self._fresh, self._others
        shared.others(self.ranks, fresh)
        for view, new, before in zip(
            (self.in_flight, self.prefill_tokens, self.decode_tokens), fresh, old, strict=True
        ):
            for slot in range(self.slots):
                change = new[slot] - before[slot]
                if change:
                    view[slot] += change
        self._others, self._fresh = fresh, old

    def admit(
        self, slot: int, decision: RouteDecision, prefill_tokens: int, total_tokens: int
    ) -> LoadTicket:
        ahead = self.prefill_tokens[slot]
        self.in_flight[slot] += 1
        self.prefill_tokens[slot] = ahead + prefill_tokens
        if self.shared is not None:
            self.shared.add(self.ranks[slot], 1, prefill_tokens, 0)
        ticket = LoadTicket(self, slot, decision, prefill_tokens, total_tokens)
        pace = self.pace
        if pace is not None:
            ticket.timed(pace.clock(), ahead)
        return ticket

    def below_max(self) -> list[int]:
        """The slots running fewer requests than their ``max_running_requests``."""
        return [
            slot
            for slot, (running, most) in enumerate(
                zip(self.in_flight, self.max_running, strict=True)
            )
            if running < most
        ]


class RecentWork:
    """Per slot: prompt tokens a rank had to prefill lately, fading with a half-life.

    The in-flight view forgets a request the moment it finishes, so at light load every rank
    looks idle and the cache is the kv policy's only signal. A prefix that every prompt shares
    (a chat template's header, a common system preamble) then pulls each new conversation onto
    the rank that saw it first, and that rank keeps them all while the others idle. What the
    idle-looking view misses is the work done there lately: those conversations come back.
    """

    __slots__ = ("_clock", "_origin", "_rate", "_raw")

    def __init__(
        self, slots: int, half_life: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        self._rate = math.log(2) / half_life
        self._clock = clock
        # Each slot's total as of ``_origin``: fading is one factor for all slots, applied
        # when read, so neither a read nor an add walks every slot.
        self._origin = clock()
        self._raw = [0.0] * slots

    def scaled(self) -> tuple[float, list[float]]:
        """``(factor, raw)``: each slot's faded total is ``factor * raw[slot]`` now."""
        factor = math.exp(-self._rate * (self._clock() - self._origin))
        if factor < 1e-150:
            # Far from the origin the raw totals would overflow: fold the factor in.
            self._raw = [tokens * factor for tokens in self._raw]
            self._origin = self._clock()
            factor = 1.0
        return factor, self._raw

    def current(self) -> list[float]:
        """Each slot's faded total as of now."""
        factor, raw = self.scaled()
        return [tokens * factor for tokens in raw]

    def add(self, slot: int, tokens: float) -> None:
        factor, raw = self.scaled()
        raw[slot] += tokens / factor


class RankPace:
    """Each rank's speed, learned from what the gateway sees: how long a request took to its
    first token against the prefill it and the requests queued ahead of it brought.

    A throttled GPU or a noisy neighbour shows as a rank whose first tokens come later for the
    same work; a router that weighs only cache and request counts keeps sending it its share.
    A request's work is its uncached prompt plus the prefill queued on its rank when it was
    sent, plus ``offset`` tokens for the engine steps any request waits through. Sums fade by
    ``keep`` per sample, so a rank that slows or recovers is seen within a few dozen requests.

    :meth:`speeds` gives each rank's pace over the median rank's; one within ``band`` of it
    counts as 1, so noise among alike ranks never moves a decision.
    """

    __slots__ = (
        "_band",
        "_keep",
        "_least",
        "_offset",
        "_seconds",
        "_speeds",
        "_work",
        "clock",
        "uneven",
    )

    def __init__(
        self,
        slots: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        keep: float = 0.97,
        offset: float = 256.0,
        band: float = 0.2,
        least: float = 1.0,
    ) -> None:
        self.clock = clock
        self._keep = keep
        self._offset = offset
        self._band = band
        # Seconds of samples a rank needs before its pace counts.
        self._least = least
        self._work = [0.0] * slots
        self._seconds = [0.0] * slots
        self._speeds = [1.0] * slots
        # Whether any rank's speed is not 1, so that alike ranks cost the route nothing.
        self.uneven = False

    def observe(self, slot: int, work: int, seconds: float) -> None:
        if seconds <= 0.0:
            return
        keep = self._keep
        self._work[slot] = self._work[slot] * keep + work + self._offset
        self._seconds[slot] = self._seconds[slot] * keep + seconds
        self._refresh()

    def _refresh(self) -> None:
        least = self._least
        rates = [
            work / seconds if seconds >= least else 0.0
            for work, seconds in zip(self._work, self._seconds, strict=True)
        ]
        known = sorted(rate for rate in rates if rate > 0.0)
        if len(known) < 2:
            return
        middle = known[len(known) // 2]
        band = self._band
        speeds = self._speeds
        uneven = False
        for slot, rate in enumerate(rates):
            ratio = rate / middle if rate > 0.0 else 1.0
            if abs(ratio - 1.0) > band:
                speeds[slot] = ratio
                uneven = True
            else:
                speeds[slot] = 1.0
        self.uneven = uneven

    def speeds(self) -> list[float]:
        """Each rank's speed over the median rank's (1: alike within the band)."""
        return self._speeds

    def rate(self, slot: int) -> float:
        """The rank's learned pace in prompt tokens a second (0 until it is known)."""
        seconds = self._seconds[slot]
        return self._work[slot] / seconds if seconds >= self._least else 0.0

    def wait(self, slot: int, queued: int) -> float:
        """Seconds ``queued`` prompt tokens take on the rank at its pace (0 while unknown)."""
        rate = self.rate(slot)
        return queued / rate if rate > 0.0 else 0.0


class LoadTicket:
    """One request's footprint; :meth:`first_token` and :meth:`finished` act at most once."""

    __slots__ = (
        "_ahead",
        "_decision",
        "_prefill",
        "_sent",
        "_slot",
        "_state",
        "_total",
        "_tracker",
    )

    _PREFILL = 0
    _DECODE = 1
    _DONE = 2

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
        self._sent = -1.0
        self._ahead = 0

    def timed(self, sent: float, ahead: int) -> None:
        """Time this request's first token for the rank's pace: sent at ``sent`` behind
        ``ahead`` prompt tokens already queued there."""
        self._sent = sent
        self._ahead = ahead

    @property
    def decision(self) -> RouteDecision:
        return self._decision

    def first_token(self) -> None:
        if self._state != self._PREFILL:
            return
        self._state = self._DECODE
        tracker = self._tracker
        slot = self._slot
        before = tracker.prefill_tokens[slot]
        after = max(0, before - self._prefill)
        tracker.prefill_tokens[slot] = after
        tracker.decode_tokens[slot] += self._total
        if tracker.shared is not None:
            tracker.shared.add(tracker.ranks[slot], 0, after - before, self._total)
        pace = tracker.pace
        if pace is not None and self._sent >= 0.0:
            pace.observe(slot, self._ahead + self._prefill, pace.clock() - self._sent)

    def finished(self) -> None:
        if self._state == self._DONE:
            return
        tracker = self._tracker
        slot = self._slot
        prefill = decode = 0
        if self._state == self._PREFILL:
            before = tracker.prefill_tokens[slot]
            tracker.prefill_tokens[slot] = max(0, before - self._prefill)
            prefill = tracker.prefill_tokens[slot] - before
        else:
            before = tracker.decode_tokens[slot]
            tracker.decode_tokens[slot] = max(0, before - self._total)
            decode = tracker.decode_tokens[slot] - before
        before = tracker.in_flight[slot]
        tracker.in_flight[slot] = max(0, before - 1)
        if tracker.shared is not None:
            tracker.shared.add(
                tracker.ranks[slot], tracker.in_flight[slot] - before, prefill, decode
            )
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
