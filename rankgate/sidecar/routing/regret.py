"""Whether the KV router's predictions come true, and which ranks' views it may trust.

A KV-aware router is only as good as its view of the caches, and that view goes wrong without
a sound: a publisher stops, events are lost past the replay window, the engine changes its
block size or event schema. The engine itself says what really happened: when a request's
prefill computes a block, the rank's KV events announce that block as stored. So for routed
requests the meter watches the prompt's block keys on the chosen rank until its prefill is
done and its events have had time to arrive; the blocks announced anew were computed, the rest
were cache hits. It watches at most one request a rank per ``interval`` (10 ms by default):
every request at light load, a sample of a busy rank's, so what it costs stops growing with
the rate (watching every request was a tenth of a short request's CPU at DP 2). Predicted
against realised hit tokens of the measured requests is the router's regret, exported per
rank and policy.

The same outcomes decide trust. A rank whose events stop while it prefills uncached prompts
(``silent``), whose events describe blocks none of our prompts have (``mismatch``: hashing or
token ids we do not expect), or whose predicted hits keep turning out to be computed
(``mispredicting``; not when the rank announced them evicted after the request was routed: a
long queue under KV pressure moves the cache, not the view), is routed by load alone after
``strikes`` such outcomes in a row, and trusted again after ``strikes`` outcomes in a row whose
predictions came true. What the intake itself sees distrusts a rank at once: an unrecoverable
gap (``gap``), event data it cannot use (``schema``, ``block_size``); fresh events, a batch
that stores blocks and is applied whole, trust it again. Each change logs one warning and
moves a gauge.

Threads: the KV-event intake thread calls :meth:`RegretMeter.stored`,
:meth:`RegretMeter.removed`, :meth:`RegretMeter.batch`, :meth:`RegretMeter.purged` and
:meth:`RegretMeter.rejected`; everything else runs on the event loop. The intake only reads the
watch tables with ``dict.get`` and bumps counters no other thread writes; a distrust is handed
over through a per-slot cell the loop consumes.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from itertools import repeat

from rankgate.sidecar.routing.base import RouteDecision, RouteTicket
from rankgate.sidecar.routing.metrics import RoutingMetrics

log = logging.getLogger(__name__)

# Purges that leave a rank's index out of step with its cache (a restart clears both).
_DISTRUSTING_PURGES = {"gap": "gap", "replay": "gap", "intake_restart": "gap"}
# Event data that could not be used: the index misses whatever it described. Events of a
# type this gateway does not know are skipped without doubt (vLLM may add types).
_DISTRUSTING_REJECTS = {"block_size": "block_size", "batch": "schema", "event": "schema"}


_NONE: frozenset[int] = frozenset()
# Settle times a rank's silence after a prefill is waited out before it counts.
_PATIENCE = 10


class Watch:
    """One routed prompt's blocks on its rank, from routing until its events are in."""

    __slots__ = (
        "batches_at",
        "deadline",
        "evicted",
        "heard_at",
        "keys",
        "lent",
        "limit",
        "matched_at",
        "owned",
        "patience",
        "predicted",
        "reserved",
        "serial",
        "slot",
        "stored",
    )

    def __init__(
        self,
        slot: int,
        keys: Sequence[int],
        predicted: int,
        limit: int,
        batches_at: int,
        matched_at: int,
        serial: int,
        lent: tuple[int, int] = (0, 0),
    ) -> None:
        self.slot = slot
        # Its place in routing order: a rank is trusted again only on requests routed after
        # it was distrusted.
        self.serial = serial
        self.keys = keys
        # Keys counted against the meter's bound until they are entered or forgotten.
        self.reserved = len(keys)
        # Blocks the router believed the rank held, and the most vLLM can hit (it always
        # computes a prompt's last token, so a whole-block prompt recomputes its last block).
        self.predicted = predicted
        self.limit = limit
        # Keys ``[start, stop)``, believed held only because an earlier request was routed here
        # with them: that request computes them, so their stores are its, not this one's.
        self.lent = lent
        # Blocks of this prompt the rank's events announced since it was routed, and the blocks
        # it watches itself (the rest an older request in flight watches).
        self.stored = 0
        # Blocks of this prompt the rank announced evicted before its prefill was done.
        self.evicted = 0
        self.owned: Sequence[int] | AbstractSet[int] = _NONE
        # The rank's KV-event batches, and its stores of watched blocks, when it was routed.
        self.batches_at = batches_at
        self.matched_at = matched_at
        self.deadline: float | None = None
        # The rank's batches when its prefill was done, and until when its silence is waited
        # out (the gateway's own intake may be behind, not the rank).
        self.heard_at = 0
        self.patience = 0.0


class _Trust:
    __slots__ = ("bad", "clean_at", "good", "reason", "since")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.since = 0
        self.bad = 0
        self.good = 0
        # Distrusted for what the intake saw: trusted again once a batch after it is clean.
        self.clean_at: int | None = None


class RegretMeter:
    """Predicted against realised cache hits per rank, and per-rank trust in the view."""

    def __init__(
        self,
        ranks: Sequence[int],
        block_size: int,
        metrics: RoutingMetrics,
        policy: str,
        *,
        settle: float,
        max_keys: int,
        strikes: int,
        clock: Callable[[], float],
        interval: float = 0.0,
    ) -> None:
        self._labels = [str(rank) for rank in ranks]
        self._block = block_size
        self._settle = settle
        self._max_keys = max_keys
        self._strikes = strikes
        self._clock = clock
        slots = len(ranks)
        # Seconds between two watches on one rank, and when each rank's next may start.
        self._interval = interval
        self._next_watch = [-math.inf] * slots
        # Per slot: block key -> the oldest watch holding it, the one that computes it. A later
        # watch of the same block (a shared prefix in flight) leaves it to that one and counts
        # it as a hit, which it is once the older request's prefill has stored it.
        self._watching: list[dict[int, Watch]] = [{} for _ in range(slots)]
        self._keys = 0
        self._serial = 0
        # Watches started whose keys are not in the tables yet (see :meth:`watch`).
        self._unregistered: list[Watch] = []
        # Watches whose prefill is done, by deadline (the settle time is one constant).
        self._due: deque[Watch] = deque()
        # Written by the intake thread only: batches heard, batches applied whole, stores of
        # watched blocks, and the latest reason to distrust with the clean count it came at.
        self._batches = [0] * slots
        self._clean = [0] * slots
        self._matched = [0] * slots
        self._distrusted: list[tuple[str, int] | None] = [None] * slots
        self._handed = False
        self._trust = [_Trust() for _ in range(slots)]
        # Slots routed by load alone: read on every route.
        self.untrusted: set[int] = set()
        m = metrics.regret
        self._predicted = [m.predicted.labels(policy, label) for label in self._labels]
        self._realised = [m.realised.labels(policy, label) for label in self._labels]
        self._missed = [m.error.labels(policy, label, "missed") for label in self._labels]
        self._unforeseen = [m.error.labels(policy, label, "unforeseen") for label in self._labels]
        self._scored = [m.scored.labels(policy, label) for label in self._labels]
        self._trusted_gauge = [m.trusted.labels(label) for label in self._labels]
        self._distrust_counter = m.distrusted
        for gauge in self._trusted_gauge:
            gauge.set(1)

    # --- the intake thread ---------------------------------------------------------------

    def stored(self, slot: int, keys: Sequence[int]) -> None:
        """The rank announced ``keys`` stored on its device: computed by the oldest watch."""
        get = self._watching[slot].get
        matched = 0
        for key in keys:
            owner = get(key)
            if owner is not None:
                owner.stored += 1
                matched += 1
        if matched:
            self._matched[slot] += matched

    def removed(self, slot: int, keys: Sequence[int]) -> None:
        """The rank announced ``keys`` evicted from its device: a watch whose prefill has not
        reached them will compute them again, though they were held when it was routed."""
        get = self._watching[slot].get
        for key in keys:
            owner = get(key)
            if owner is not None and owner.deadline is None:
                owner.evicted += 1

    def batch(self, slot: int, clean: bool) -> None:
        """A batch was applied; ``clean``: it stored blocks and none of its events had to be
        refused (a batch of removals alone shows nothing about how blocks are keyed)."""
        self._batches[slot] += 1
        if clean:
            self._clean[slot] += 1

    def purged(self, slot: int, reason: str) -> None:
        """The intake cleared the rank's index; after a gap it is out of step with the cache."""
        cause = _DISTRUSTING_PURGES.get(reason)
        if cause is not None:
            self._distrusted[slot] = (cause, self._clean[slot])
            self._handed = True

    def rejected(self, slot: int, reason: str) -> None:
        """The intake could not use what the rank sent: the index misses what it described."""
        cause = _DISTRUSTING_REJECTS.get(reason)
        if cause is not None:
            self._distrusted[slot] = (cause, self._clean[slot])
            self._handed = True

    # --- the event loop ------------------------------------------------------------------

    def trusted(self, slot: int) -> bool:
        return slot not in self.untrusted

    def due(self, slot: int) -> bool:
        """Whether the next request routed to ``slot`` is to be measured: the first after each
        ``interval``. A busy rank is measured on one request in so many, so the meter's cost
        stops growing with the request rate while its outcomes still come in routing order
        (strikes count the same way, fewer per second)."""
        if not self._interval:
            return True
        now = self._clock()
        if now < self._next_watch[slot]:
            return False
        self._next_watch[slot] = now + self._interval
        return True

    def watch(
        self,
        slot: int,
        keys: Sequence[int],
        predicted: int,
        limit: int,
        blocks: int | None = None,
        lent: tuple[int, int] = (0, 0),
    ) -> Watch | None:
        """Start watching a prompt routed to ``slot``; None when the bound on watched keys is
        reached (the request then goes unmeasured).

        ``keys`` may still be growing (:class:`~rankgate.sidecar.routing.hashing.KeyChain`) until
        the request is on its way; ``blocks`` is how many it will hold then. Its keys are entered
        in the rank's table by :meth:`register`, once the request is on its way
        (``Router.sent``): a long prompt is a hundred dictionary writes that need not delay
        it, and no event about its blocks can come before the engine has it.

        ``lent``: the keys ``[start, stop)`` the rank was believed to hold by the routes of
        earlier requests alone, not by its events. Those requests compute them; a watch of
        theirs would own them, and when they went unmeasured (:meth:`due`) this one leaves
        them to them all the same, counting them as hits."""
        count = len(keys) if blocks is None else blocks
        if not count or self._keys + count > self._max_keys:
            return None
        self._serial += 1
        watch = Watch(
            slot,
            keys,
            predicted,
            limit,
            self._batches[slot],
            self._matched[slot],
            self._serial,
            lent,
        )
        # Reserved now, so the bound holds for the watches not yet registered.
        watch.reserved = count
        self._keys += count
        self._unregistered.append(watch)
        return watch

    def register(self) -> None:
        """Enter the keys of the watches started since the last call in their ranks' tables."""
        pending = self._unregistered
        if not pending:
            return
        self._unregistered = []
        for watch in pending:
            keys = watch.keys
            start, stop = watch.lent
            if start < stop:
                keys = [*keys[:start], *keys[stop:]]
            table = self._watching[watch.slot]
            owned: Sequence[int] | AbstractSet[int] = keys
            if not table.keys().isdisjoint(keys):
                owned = set(keys) - table.keys()
            table.update(zip(owned, repeat(watch)))
            watch.owned = owned
            self._keys -= watch.reserved - len(owned)

    def prefilled(self, watch: Watch) -> None:
        """Its prefill is done: score it once its events have had time to arrive."""
        self.register()
        if watch.deadline is None:
            now = self._clock()
            watch.deadline = now + self._settle
            watch.heard_at = self._batches[watch.slot]
            watch.patience = now + _PATIENCE * self._settle
            self._due.append(watch)

    def dropped(self, watch: Watch) -> None:
        """It ended before its prefill did: nothing to score."""
        self.register()
        if watch.deadline is None:
            watch.deadline = -1.0
            self._forget(watch)

    def settle(self) -> None:
        """Score the watches that are due, and apply distrust handed over by the intake."""
        self.register()
        if self._handed:
            self._handed = False
            for slot, handed in enumerate(self._distrusted):
                if handed is not None:
                    self._distrusted[slot] = None
                    reason, clean_at = handed
                    if self._set_untrusted(slot, reason):
                        self._trust[slot].clean_at = clean_at
        if self.untrusted:
            for slot in list(self.untrusted):
                since = self._trust[slot].clean_at
                if since is not None and self._clean[slot] > since:
                    self._set_trusted(slot)
        due = self._due
        if not due:
            return
        now = self._clock()
        while due and (due[0].deadline or 0.0) <= now:
            watch = due.popleft()
            if self._unheard(watch) and now < watch.patience:
                watch.deadline = now + self._settle
                due.append(watch)
                continue
            self._forget(watch)
            self._score(watch)

    def _unheard(self, watch: Watch) -> bool:
        """Nothing came from its rank since its prefill, though it computed blocks."""
        return (
            watch.stored == 0
            and len(watch.keys) > watch.predicted
            and self._batches[watch.slot] == watch.heard_at
        )

    def _forget(self, watch: Watch) -> None:
        owned = watch.owned
        if not owned:
            return
        # No other watch can hold these keys while this one does.
        deque(map(self._watching[watch.slot].__delitem__, owned), maxlen=0)
        self._keys -= len(owned)
        watch.owned = _NONE

    def _score(self, watch: Watch) -> None:
        slot = watch.slot
        block = self._block
        total = min(len(watch.keys), watch.limit)
        stored = min(watch.stored, len(watch.keys))
        realised = max(0, min(len(watch.keys) - stored, total))
        predicted = min(watch.predicted, total)
        self._predicted[slot].inc(predicted * block)
        self._realised[slot].inc(realised * block)
        if predicted > realised:
            self._missed[slot].inc((predicted - realised) * block)
        elif realised > predicted:
            self._unforeseen[slot].inc((realised - predicted) * block)
        self._scored[slot].inc()
        self._judge(watch, self._verdict(watch, predicted, realised))

    def _verdict(self, watch: Watch, predicted: int, realised: int) -> str | None:
        """None when the prediction came true, else why not; "" when this one cannot tell."""
        slot = watch.slot
        if len(watch.keys) > predicted and watch.stored == 0:
            if self._matched[slot] > watch.matched_at:
                # Its blocks were announced, for an older request computing the same prefix.
                return ""
            return "mismatch" if self._batches[slot] > watch.batches_at else "silent"
        if predicted > 0 and realised * 2 < predicted:
            if (realised + watch.evicted) * 2 >= predicted:
                # Held when routed, evicted while it waited: the cache moved, not the view.
                return ""
            return "mispredicting"
        return None

    def _judge(self, watch: Watch, reason: str | None) -> None:
        slot = watch.slot
        trust = self._trust[slot]
        if reason == "" or (trust.reason is not None and watch.serial <= trust.since):
            return
        if reason is None:
            trust.bad = 0
            trust.good += 1
            if trust.reason is not None and trust.good >= self._strikes:
                self._set_trusted(slot)
            return
        trust.good = 0
        trust.bad += 1
        if trust.reason is None and trust.bad >= self._strikes:
            self._set_untrusted(slot, reason)

    def refuses(self, reason: str) -> bool:
        """Whether the intake refusing an event for ``reason`` leaves its batch unclean."""
        return reason in _DISTRUSTING_REJECTS

    def _set_untrusted(self, slot: int, reason: str) -> bool:
        """Distrust the rank for ``reason``; False when it was distrusted already."""
        trust = self._trust[slot]
        trust.good = 0
        if trust.reason is not None:
            return False
        trust.reason = reason
        trust.since = self._serial
        self.untrusted.add(slot)
        self._trusted_gauge[slot].set(0)
        self._distrust_counter.labels(self._labels[slot], reason).inc()
        log.warning(
            "routing rank %s by load alone: its KV view is not trustworthy (%s)",
            self._labels[slot],
            reason,
        )
        return True

    def _set_trusted(self, slot: int) -> None:
        trust = self._trust[slot]
        log.warning(
            "routing rank %s on its KV view again: its predictions come true (was %s)",
            self._labels[slot],
            trust.reason,
        )
        trust.reason = None
        trust.clean_at = None
        trust.bad = 0
        self.untrusted.discard(slot)
        self._trusted_gauge[slot].set(1)


class WatchedTicket:
    """A routed request's ticket that also tells the meter when its prefill is done."""

    __slots__ = ("_inner", "_meter", "_watch")

    def __init__(self, inner: RouteTicket, meter: RegretMeter, watch: Watch) -> None:
        self._inner = inner
        self._meter = meter
        self._watch = watch

    @property
    def decision(self) -> RouteDecision:
        return self._inner.decision

    def first_token(self) -> None:
        self._inner.first_token()
        self._meter.prefilled(self._watch)

    def finished(self) -> None:
        self._inner.finished()
        self._meter.dropped(self._watch)
