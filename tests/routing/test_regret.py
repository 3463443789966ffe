"""The router checks its predictions against the ranks' KV events (rankgate.sidecar.routing.regret):
predicted and realised hit tokens, and per-rank trust, from each cause of an untrustworthy view
to its recovery. The meter on its own clock here; through the gateway and the mock in
``test_gateway_regret.py``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.metrics import routing_metrics
from rankgate.sidecar.routing.regret import RegretMeter
from tests.routing.conftest import BLOCK as RIG_BLOCK
from tests.routing.conftest import RigFactory, prepared, sample
from tests.routing.publisher import removed, stored

BLOCK = 16
STRIKES = 3
Hand = Callable[[RegretMeter], None]
SETTLE = 1.0


class Clocked:
    def __init__(self, interval: float = 0.0) -> None:
        self.now = 0.0
        self.registry = CollectorRegistry()
        self.meter = RegretMeter(
            (0, 1),
            BLOCK,
            routing_metrics(self.registry),
            "kv",
            settle=SETTLE,
            max_keys=64,
            strikes=STRIKES,
            clock=lambda: self.now,
            interval=interval,
        )

    def request(
        self,
        keys: list[int],
        predicted: int,
        stored: list[int] | None = None,
        *,
        slot: int = 0,
        heard: bool = True,
    ) -> None:
        """Route, prefill (the rank announcing ``stored``), and let it be scored."""
        watch = self.meter.watch(slot, keys, predicted, len(keys))
        assert watch is not None
        self.meter.prefilled(watch)
        if stored or heard:
            self.meter.batch(slot, True)
        if stored:
            self.meter.stored(slot, stored)
        self.now += SETTLE
        self.meter.settle()
        if not heard:
            # Silence is waited out before it counts.
            self.now += 10 * SETTLE
            self.meter.settle()

    def value(self, name: str, **labels: str) -> float:
        return sample(self.registry, name, **labels)

    def trusted(self, rank: int = 0) -> float:
        return self.value("rankgate_routing_kv_view_trusted", rank=str(rank))


def test_a_prediction_that_comes_true_has_no_regret() -> None:
    m = Clocked()
    # Two of four blocks believed held; the rank computes the other two.
    m.request([1, 2, 3, 4], predicted=2, stored=[3, 4])
    assert m.value("rankgate_routing_predicted_hit_tokens_total", policy="kv", rank="0") == 32
    assert m.value("rankgate_routing_realised_hit_tokens_total", policy="kv", rank="0") == 32
    for direction in ("missed", "unforeseen"):
        labels = {"policy": "kv", "rank": "0", "direction": direction}
        assert m.value("rankgate_routing_hit_error_tokens_total", **labels) == 0
    assert m.value("rankgate_routing_measured_requests_total", policy="kv", rank="0") == 1
    assert m.trusted() == 1


def test_missed_and_unforeseen_hits_are_counted_apart() -> None:
    m = Clocked()
    m.request([1, 2, 3, 4], predicted=3, stored=[2, 3, 4])  # believed 3, held 1
    m.request([5, 6, 7, 8], predicted=0, stored=[8])  # believed none, held 3
    error = "rankgate_routing_hit_error_tokens_total"
    assert m.value(error, policy="kv", rank="0", direction="missed") == 2 * BLOCK
    assert m.value(error, policy="kv", rank="0", direction="unforeseen") == 3 * BLOCK


def test_a_request_is_scored_only_after_its_events_had_time_to_arrive() -> None:
    m = Clocked()
    watch = m.meter.watch(0, [1, 2], 0, 2)
    assert watch is not None
    m.meter.prefilled(watch)
    m.now += SETTLE / 2
    m.meter.settle()
    assert m.value("rankgate_routing_measured_requests_total", policy="kv", rank="0") == 0
    m.meter.stored(0, [1, 2])  # late, but within the settle time
    m.now += SETTLE
    m.meter.settle()
    assert m.value("rankgate_routing_realised_hit_tokens_total", policy="kv", rank="0") == 0


def test_a_request_that_ends_before_its_prefill_is_not_scored_and_frees_its_keys() -> None:
    m = Clocked()
    for _ in range(10):  # 10 x 8 keys would pass the bound of 64 if they were kept
        watch = m.meter.watch(0, list(range(8)), 0, 8)
        assert watch is not None
        m.meter.dropped(watch)
    m.now += SETTLE
    m.meter.settle()
    assert m.value("rankgate_routing_measured_requests_total", policy="kv", rank="0") == 0


def test_keys_still_hashing_count_whole_against_the_bound_and_are_all_freed() -> None:
    m = Clocked()
    growing = list(range(8))  # a prompt of 40 blocks, 8 hashed when it was routed
    first = m.meter.watch(0, growing, 0, 40, blocks=40)
    assert first is not None
    # Its 40 are reserved: 30 more would pass the bound of 64.
    assert m.meter.watch(1, list(range(100, 130)), 0, 30) is None
    # Ended before it was sent, its keys never finished: all 40 are freed all the same.
    m.meter.dropped(first)
    for _ in range(5):
        watch = m.meter.watch(0, list(range(200, 260)), 0, 60)
        assert watch is not None
        m.meter.dropped(watch)


def test_a_busy_rank_is_measured_once_an_interval_and_each_rank_apart() -> None:
    m = Clocked(interval=0.01)
    assert m.meter.due(0)
    m.now = 0.005
    assert not m.meter.due(0)
    assert m.meter.due(1)
    assert not m.meter.due(1)
    m.now = 0.01
    assert m.meter.due(0)
    assert not m.meter.due(0)
    assert Clocked().meter.due(0)
    assert Clocked().meter.due(0)


def test_blocks_an_unmeasured_earlier_request_computes_are_its_own() -> None:
    """The rank was believed to hold blocks 3 and 4 only because an unmeasured request was
    routed there with them; their stores, arriving after this request was routed, are that
    request's, so this one's prediction of four blocks came true."""
    m = Clocked()
    watch = m.meter.watch(0, [1, 2, 3, 4, 5], 4, 4, lent=(2, 4))
    assert watch is not None
    m.meter.prefilled(watch)
    m.meter.batch(0, True)
    m.meter.stored(0, [3, 4, 5])
    m.now += SETTLE
    m.meter.settle()
    assert m.value("rankgate_routing_predicted_hit_tokens_total", policy="kv", rank="0") == 64
    assert m.value("rankgate_routing_realised_hit_tokens_total", policy="kv", rank="0") == 64
    assert m.trusted() == 1


def test_watching_is_bounded_in_keys() -> None:
    m = Clocked()
    assert m.meter.watch(0, list(range(60)), 0, 60) is not None
    assert m.meter.watch(0, list(range(100, 110)), 0, 10) is None


@pytest.mark.parametrize(
    ("cause", "predicted", "stored", "heard"),
    [
        # The publisher stopped while the rank prefills uncached prompts.
        ("silent", 0, [], False),
        # Events flow but describe none of the prompt's blocks (block keys, token ids).
        ("mismatch", 0, [], True),
        # Blocks believed held keep being computed.
        ("mispredicting", 4, [1, 2, 3, 4], True),
    ],
)
def test_untrue_predictions_in_a_row_route_a_rank_by_load_until_they_come_true(
    caplog: pytest.LogCaptureFixture,
    cause: str,
    predicted: int,
    stored: list[int],
    heard: bool,
) -> None:
    m = Clocked()
    caplog.set_level(logging.WARNING, "rankgate.sidecar.routing.regret")
    for n in range(STRIKES):
        assert m.trusted() == 1
        keys = [1, 2, 3, 4] if cause == "mispredicting" else [10 * n + 1, 10 * n + 2]
        m.request(keys, predicted, [k for k in stored if k in keys] or None, heard=heard)
    assert m.trusted() == 0
    assert m.meter.untrusted == {0}
    distrusted = "rankgate_routing_kv_view_distrusted_total"
    assert m.value(distrusted, rank="0", reason=cause) == 1
    # The other rank is not touched.
    assert m.trusted(1) == 1
    # More of the same logs nothing more.
    m.request([91, 92], predicted, None, heard=heard)
    assert [r.getMessage() for r in caplog.records] == [
        f"routing rank 0 by load alone: its KV view is not trustworthy ({cause})"
    ]
    # Predictions that come true, as many in a row, restore it.
    for n in range(STRIKES):
        m.request([200 + 10 * n, 201 + 10 * n], predicted=0, stored=[200 + 10 * n, 201 + 10 * n])
    assert m.trusted() == 1
    assert m.meter.untrusted == set()
    assert len(caplog.records) == 2


def test_one_good_outcome_between_strikes_starts_the_count_again() -> None:
    m = Clocked()
    for n in range(2 * STRIKES):
        m.request([10 * n + 1], predicted=0, heard=False)
        if n % (STRIKES - 1) == STRIKES - 2:
            m.request([10 * n + 5], predicted=0, stored=[10 * n + 5])
    assert m.trusted() == 1


def test_an_older_request_computing_the_same_blocks_is_no_strike() -> None:
    m = Clocked()
    first = m.meter.watch(0, [1, 2], 0, 2)
    for _ in range(STRIKES):
        second = m.meter.watch(0, [1, 2], 0, 2)
        assert first is not None
        assert second is not None
        m.meter.stored(0, [1, 2])  # attributed to the oldest watch
        m.meter.batch(0, True)
        m.meter.prefilled(second)
        m.now += SETTLE
        m.meter.settle()
    assert m.trusted() == 1


@pytest.mark.parametrize(
    ("hand", "reason"),
    [
        (lambda meter: meter.purged(0, "gap"), "gap"),
        (lambda meter: meter.purged(0, "replay"), "gap"),
        (lambda meter: meter.rejected(0, "block_size"), "block_size"),
        (lambda meter: meter.rejected(0, "event"), "schema"),
    ],
)
def test_what_the_intake_sees_distrusts_at_once_until_a_whole_batch(
    hand: Hand, reason: str
) -> None:
    m = Clocked()
    hand(m.meter)
    m.meter.batch(0, False)  # the batch with the refused event, or the first after a gap
    m.meter.settle()
    assert m.trusted() == 0
    assert m.value("rankgate_routing_kv_view_distrusted_total", rank="0", reason=reason) == 1
    m.meter.batch(0, True)
    m.meter.settle()
    assert m.trusted() == 1


@pytest.mark.parametrize(
    "hand",
    [
        lambda meter: meter.purged(0, "restart"),  # the engine's cache went with it
        lambda meter: meter.rejected(0, "event_type"),  # a type vLLM added is skipped
        lambda meter: meter.rejected(0, "unknown_parent"),
    ],
)
def test_what_leaves_the_view_sound_distrusts_nothing(hand: Hand) -> None:
    m = Clocked()
    hand(m.meter)
    m.meter.settle()
    assert m.trusted() == 1


def test_events_late_because_the_intake_is_behind_are_waited_for() -> None:
    m = Clocked()
    for n in range(STRIKES):
        watch = m.meter.watch(0, [10 * n + 1, 10 * n + 2], 0, 2)
        assert watch is not None
        m.meter.prefilled(watch)
        m.now += 5 * SETTLE  # nothing from the rank yet: not a verdict
        m.meter.settle()
        assert m.value("rankgate_routing_measured_requests_total", policy="kv", rank="0") == n
        m.meter.batch(0, True)
        m.meter.stored(0, [10 * n + 1, 10 * n + 2])
        m.now += SETTLE
        m.meter.settle()
    assert m.value("rankgate_routing_measured_requests_total", policy="kv", rank="0") == STRIKES
    assert m.trusted() == 1


@pytest.mark.parametrize("evicted", [True, False], ids=["evicted-while-waiting", "never-evicted"])
def test_blocks_evicted_after_routing_are_no_strike(evicted: bool) -> None:
    m = Clocked()
    for n in range(2 * STRIKES):
        keys = [10 * n + 1, 10 * n + 2, 10 * n + 3, 10 * n + 4]
        watch = m.meter.watch(0, keys, 4, 4)
        assert watch is not None
        m.meter.register()
        if evicted:
            # Held when routed, evicted while the request waited for its turn to prefill.
            m.meter.removed(0, keys[:3])
        m.meter.prefilled(watch)
        m.meter.batch(0, True)
        m.meter.stored(0, keys[:3])
        m.now += SETTLE
        m.meter.settle()
    assert m.trusted() == (1 if evicted else 0)


@pytest.mark.parametrize("evicted", [True, False], ids=["evicted-while-waiting", "never-evicted"])
async def test_the_intake_tells_the_meter_of_evictions(
    event_rig: RigFactory, evicted: bool
) -> None:
    """Through the KV-event intake: a prompt the rank held when it was routed, evicted and
    computed again before its prefill, three times in a row, leaves the rank trusted; the same
    without the removals distrusts it."""
    now = [time.monotonic()]
    rig = await event_rig(
        config=RoutingConfig(share_weight=0, regret_settle=0.05), clock=lambda: now[0]
    )
    router = rig.intake_router
    meter = router.regret
    assert meter is not None
    batches = 0
    for n in range(STRIKES):
        tokens = list(range(1000 * (n + 1), 1000 * (n + 1) + 4 * RIG_BLOCK))
        ids = [100 * (n + 1) + i for i in range(4)]
        rig.publishers[0].publish([stored(ids, tokens, block_size=RIG_BLOCK)])
        batches += 1
        await rig.settle(0, batches)
        ticket = router.route(prepared([*tokens, 1], f"r{n}"))
        router.sent()
        assert (ticket.decision.rank, ticket.decision.cached_tokens) == (0, 4 * RIG_BLOCK)
        if evicted:
            rig.publishers[0].publish([removed(ids)])
            batches += 1
            await rig.settle(0, batches)
        # Its prefill computes the four blocks: the rank announces them stored.
        again = [i + 50 for i in ids]
        rig.publishers[0].publish([stored(again, tokens, block_size=RIG_BLOCK)])
        batches += 1
        await rig.settle(0, batches)
        ticket.first_token()
        ticket.finished()
        now[0] += 0.1  # past the settle window
        meter.settle()
    assert meter.trusted(0) is evicted
