"""Client affinity keys: a named conversation goes where its earlier turns went before any KV
event says so, as a hint that yields to load; the table is bounded and forgets."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.affinity import AffinityTable
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.metrics import routing_metrics
from rankgate.sidecar.routing.policies import KvRouter
from rankgate.sidecar.types import KvEventSource
from tests.routing.conftest import BLOCK, engine_info, prepared, sample

SOURCES = [KvEventSource(rank, f"tcp://127.0.0.1:{9 + rank}", None, "") for rank in (0, 1)]
# KV events on but none arrived yet, and no predictions from past routes: what the router
# knows of the caches is the affinity keys alone.
CONFIG = RoutingConfig(pending_ttl=0, share_weight=0, decode_weight=0, recent_weight=0)


def _router(config: RoutingConfig = CONFIG) -> tuple[KvRouter, CollectorRegistry]:
    registry = CollectorRegistry()
    router = KvRouter(config, routing_metrics(registry))
    router.configure(engine_info((0, 1), sources=SOURCES))
    return router, registry


def test_the_table_is_a_bounded_lru_whose_entries_expire() -> None:
    now = [0.0]
    table = AffinityTable(2, ttl=10.0, clock=lambda: now[0])
    table.record("a", 0, 100)
    table.record("b", 1, 200)
    table.record("a", 0, 150)  # "b" is now the least recently recorded
    table.record("c", 1, 300)
    assert table.get("b") is None
    assert table.get("a") == (0, 150)
    assert len(table) == 2
    now[0] = 10.0
    assert table.get("a") is None
    assert table.get("c") is None


def test_a_named_conversation_stays_on_its_rank_before_any_kv_event() -> None:
    router, registry = _router()
    history = list(range(1000, 4000))
    first = router.route(prepared([*history, 1], "turn-1", affinity="conv"))
    home = first.decision.rank
    assert home is not None
    first.finished()
    # Another request's prefill queues on that rank: 2000 tokens of work ahead.
    busy = router.route(prepared(list(range(5000, 7000)), "busy", rank=home))
    anonymous = router.route(prepared([*history, 2], "anonymous"))
    anonymous.finished()
    # Without a key, nothing says the history is there: the idle rank is cheaper.
    assert anonymous.decision.rank == 1 - home
    named = router.route(prepared([*history, 3], "turn-2", affinity="conv"))
    named.finished()
    assert named.decision.rank == home
    assert named.decision.cached_tokens == len(history) // BLOCK * BLOCK
    assert sample(registry, "rankgate_routing_affinity_total", outcome="followed") == 1
    busy.finished()


def test_affinity_yields_when_the_rank_is_too_busy_and_then_follows_the_new_rank() -> None:
    router, registry = _router()
    history = list(range(1000, 2000))
    first = router.route(prepared([*history, 1], "turn-1", affinity="conv"))
    home = first.decision.rank
    assert home is not None
    first.finished()
    # 4000 queued tokens there outweigh recomputing the 1000-token history elsewhere.
    busy = [
        router.route(prepared(list(range(5000 + k, 7000 + k)), f"b{k}", rank=home)) for k in (0, 1)
    ]
    moved = router.route(prepared([*history, 2], "turn-2", affinity="conv"))
    moved.finished()
    assert moved.decision.rank == 1 - home
    assert sample(registry, "rankgate_routing_affinity_total", outcome="yielded") == 1
    for ticket in busy:
        ticket.finished()
    # The conversation lives where it went last.
    again = router.route(prepared([*history, 2, 3], "turn-3", affinity="conv"))
    assert again.decision.rank == 1 - home


def test_affinity_can_be_turned_off() -> None:
    router, registry = _router(RoutingConfig(pending_ttl=0, share_weight=0, affinity_entries=0))
    router.route(prepared([1, 2, 3, 4, 5], "a", affinity="conv")).finished()
    router.route(prepared([1, 2, 3, 4, 5, 6], "b", affinity="conv")).finished()
    assert router.affinity is None
    assert sample(registry, "rankgate_routing_affinity_total", outcome="followed") == 0
