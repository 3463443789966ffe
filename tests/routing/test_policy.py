"""Each policy's decisions through the public Router surface: route, tickets, configure."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rankgate.sidecar.errors import EngineUnavailable
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.events import IntakeSettings
from rankgate.sidecar.routing.hashing import prompt_keys
from rankgate.sidecar.routing.metrics import routing_metrics
from rankgate.sidecar.routing.policies import KvRouter, build_router
from rankgate.sidecar.types import MediaInput
from tests.routing.conftest import BLOCK, RigFactory, engine_info, prepared, sample
from tests.routing.publisher import stored

P = list(range(1000, 1016))
TAIL = [7]
PROBE = RoutingConfig(share_weight=0, pending_ttl=0)


async def test_hot_prefix_spills_to_the_least_busy_rank(event_rig: RigFactory) -> None:
    rig = await event_rig(config=RoutingConfig(share_weight=0, pending_ttl=0, hot_spill_requests=2))
    rig.publishers[0].publish([stored([1, 2, 3, 4], P, block_size=BLOCK)])
    await rig.settle(0, 1)

    tickets = [rig.router.route(prepared(P + TAIL, f"r{i}")) for i in range(4)]
    ranks = [t.decision.rank for t in tickets]
    reasons = [t.decision.reason for t in tickets]
    # Three on the cached rank (0, 1 and 2 ahead of the idle one), then the guard spills.
    assert ranks == [0, 0, 0, 1]
    assert reasons == ["best", "best", "best", "spill_hot"]
    assert tickets[3].decision.cached_tokens == 0
    # Once the hot rank drains, the prefix pulls requests back.
    for ticket in tickets:
        ticket.finished()
    assert rig.route(P + TAIL) == (0, 16)
    assert sample(rig.registry, "rankgate_routing_spills_total", reason="hot_prefix") == 1


async def test_no_rank_above_capacity_while_another_has_room(event_rig: RigFactory) -> None:
    config = RoutingConfig(share_weight=0, pending_ttl=0, hot_spill_requests=100)
    rig = await event_rig(config=config, max_running=2)
    rig.publishers[0].publish([stored([1, 2, 3, 4], P, block_size=BLOCK)])
    await rig.settle(0, 1)

    tickets = [rig.router.route(prepared(P + TAIL, f"r{i}")) for i in range(5)]
    # Rank 0 holds the prefix but runs at most two; the fifth finds both full and takes the
    # cheapest again, since vLLM queues it either way.
    assert [t.decision.rank for t in tickets] == [0, 0, 1, 1, 0]
    assert [t.decision.reason for t in tickets][2:4] == ["spill_capacity", "spill_capacity"]
    for ticket in tickets:
        ticket.finished()
    assert rig.router.route(prepared(P + TAIL, "again")).decision.rank == 0


@pytest.mark.parametrize(("queue_weight", "waits"), [(1.0, False), (0.5, True)])
async def test_cost_trades_cached_prefix_against_queued_prefill(
    queue_weight: float, waits: bool
) -> None:
    config = RoutingConfig(share_weight=0, decode_weight=0.0, queue_weight=queue_weight)
    router = build_router(config, CollectorRegistry())
    router.configure(engine_info((0, 1)))
    long_prompt = list(range(100, 400))
    first = router.route(prepared(long_prompt, "a"))
    # While the first is still prefilling, its rank has 300 tokens queued and (predicted)
    # 296 of the prompt's: 4 + 300 * queue_weight against re-prefilling all 300 on the idle
    # rank. Counted in full, the queue sends the copy away; at the default half, it waits for
    # the cached prefix rather than compute it twice.
    during = router.route(prepared(long_prompt, "b"))
    assert (during.decision.rank == first.decision.rank) is waits
    during.finished()
    first.first_token()
    # Prefill done: the prompt is (predicted) cached there, so the next one stays.
    after = router.route(prepared(long_prompt, "c"))
    assert after.decision.rank == first.decision.rank
    # vLLM hits whole blocks and computes the last token: (300 - 1) // 8 * 8.
    assert after.decision.cached_tokens == 296
    # A different prompt goes where nothing is queued.
    other = router.route(prepared(list(range(5000, 5300)), "d"))
    assert other.decision.rank != first.decision.rank


@pytest.mark.parametrize(
    ("copy_weight", "room", "stays"),
    [(0.5, False, True), (0.5, True, False), (0.0, False, False)],
    ids=["full", "room", "off"],
)
async def test_a_copy_that_evicts_costs_what_it_evicts(
    event_rig: RigFactory, copy_weight: float, room: bool, stays: bool
) -> None:
    # Rank 0 holds a 96-token prompt and has 200 tokens of prefill queued; rank 1 is idle.
    config = RoutingConfig(
        share_weight=0, decode_weight=0, recent_weight=0, copy_weight=copy_weight
    )
    rig = await event_rig(config=config, kv_blocks=64)
    held = list(range(3000, 3096))
    rig.publishers[0].publish([stored(list(range(1, 25)), held, block_size=BLOCK)])
    await rig.settle(0, 1)
    if not room:
        # Rank 1's cache is full (64 blocks of another prompt): computing the copy there evicts.
        other = list(range(6000, 6256))
        rig.publishers[1].publish([stored(list(range(101, 165)), other, block_size=BLOCK)])
        await rig.settle(1, 1)
    queued = rig.router.route(prepared(list(range(9000, 9200)), "queued", rank=0))
    # Rank 0: 4 tokens to prefill plus half of the 200 queued (104); rank 1: all 100, and with
    # a full cache half the 96 held on rank 0 again, for the blocks they evict there (148).
    ticket = rig.router.route(prepared([*held, 1, 2, 3, 4], "next"))
    assert (ticket.decision.rank == 0) is stays
    ticket.finished()
    queued.finished()


async def test_a_prefix_every_prompt_shares_does_not_herd_new_conversations(
    event_rig: RigFactory,
) -> None:
    # Rank 0 announced the header that every prompt starts with; each conversation finishes
    # before the next arrives, so no rank ever has work in flight.
    rig = await event_rig(config=PROBE)
    rig.publishers[0].publish([stored([1], P, block_size=BLOCK)])
    await rig.settle(0, 1)
    ranks = []
    for n in range(8):
        system = list(range(2000 + 100 * n, 2064 + 100 * n))
        ticket = rig.router.route(prepared([*P, *system], f"c{n}"))
        ticket.first_token()
        ticket.finished()
        ranks.append(ticket.decision.rank)
    # Work done lately outweighs the one shared block: conversations alternate.
    assert ranks.count(0) == ranks.count(1) == 4

    # Without the recent-work term the header alone decides: all of them go to rank 0.
    herd = await event_rig(config=RoutingConfig(share_weight=0, pending_ttl=0, recent_weight=0))
    herd.publishers[0].publish([stored([1], P, block_size=BLOCK)])
    # The registry is shared with the first rig, whose batch counted already.
    await herd.settle(0, 2)
    for n in range(8):
        ticket = herd.router.route(prepared([*P, *range(5000 + 100 * n, 5064 + 100 * n)]))
        ticket.finished()
        assert ticket.decision.rank == 0


async def test_recent_work_fades_and_never_outweighs_a_long_cached_prefix(
    event_rig: RigFactory,
) -> None:
    config = RoutingConfig(share_weight=0, pending_ttl=0, recent_half_life=0.2)
    now = [0.0]
    rig = await event_rig(config=config, clock=lambda: now[0])
    history = list(range(3000, 3000 + 8 * BLOCK))
    rig.publishers[0].publish([stored(list(range(10, 18)), history, block_size=BLOCK)])
    await rig.settle(0, 1)
    # Lots of recent work on rank 0 still loses to re-prefilling the whole history elsewhere.
    for n in range(5):
        ticket = rig.router.route(prepared([*history, 40 + n], f"turn{n}"))
        ticket.finished()
        assert ticket.decision.rank == 0
        assert ticket.decision.cached_tokens == len(history)
    assert isinstance(rig.router, KvRouter)
    recent = rig.router.recent
    assert recent is not None
    before = recent.current()[0]
    assert before > 0
    now[0] += 0.4
    # Two half-lives later a quarter is left.
    assert recent.current()[0] == pytest.approx(before / 4)


async def test_a_rank_sent_more_than_its_share_opens_a_second_copy_of_a_hot_prefix() -> None:
    now = [0.0]
    config = RoutingConfig(
        decode_weight=0.0,
        recent_weight=0.0,
        share_weight=10.0,
        share_half_life=5.0,
        share_slack=0.0,
    )
    router = KvRouter(config, routing_metrics(CollectorRegistry()), lambda: now[0])
    router.configure(engine_info((0, 1)))
    system = list(range(1000, 1064))
    history = [*system, *range(2000, 2400)]
    first = router.route(prepared([*history, 1], "history"))
    first.finished()
    holder = first.decision.rank
    assert holder is not None

    def conversation(n: int) -> tuple[int | None, int]:
        ticket = router.route(prepared([*system, *range(5000 + 8 * n, 5008 + 8 * n)], f"c{n}"))
        ticket.finished()
        return ticket.decision.rank, ticket.decision.cached_tokens

    # The holder answers new conversations cheaply until its surplus of recent requests
    # (half of them, with two ranks) outweighs a cold prefill of the 64-token prompt.
    ranks = [conversation(n)[0] for n in range(12)]
    assert ranks == [holder] * 12
    rank, cached = conversation(12)
    assert (rank, cached) == (1 - holder, 0)
    # The new copy serves the next conversations from its cache while the holder's surplus
    # lasts.
    assert [conversation(n) for n in range(13, 17)] == [(1 - holder, len(system))] * 4
    # A conversation with a long cached history stays where it is, surplus or not.
    ticket = router.route(prepared([*history, 2], "turn"))
    assert ticket.decision.rank == holder
    assert ticket.decision.cached_tokens == len(history) // BLOCK * BLOCK
    # The surplus fades: ten half-lives later the holder is as cheap as ever.
    now[0] += 50.0
    assert router.shares is not None
    assert max(router.shares.current()) < 0.02


async def test_decode_load_counts_after_first_token() -> None:
    config = RoutingConfig(share_weight=0, prefill_weight=1.0, decode_weight=1.0)
    router = build_router(config, CollectorRegistry())
    router.configure(engine_info((0, 1)))
    big = router.route(prepared(list(range(3000)), "big"))
    big.first_token()
    small = router.route(prepared(list(range(9000, 9100)), "small"))
    assert small.decision.rank != big.decision.rank
    big.finished()
    big.finished()
    big.first_token()


@pytest.mark.parametrize(("cap", "stays"), [(8192, True), (0, False)], ids=["capped", "all"])
async def test_long_decoding_contexts_do_not_push_a_turn_off_its_history(
    cap: int, stays: bool
) -> None:
    config = RoutingConfig(share_weight=0, recent_weight=0, decode_tokens_cap=cap)
    router = build_router(config, CollectorRegistry())
    router.configure(engine_info((0, 1), kv_blocks=65536))
    history = list(range(100, 4100))
    first = router.route(prepared(history, "turn1"))
    router.sent()
    first.first_token()
    first.finished()
    holder = first.decision.rank
    assert holder is not None
    # Three agent contexts of 20k tokens decode on the holder; the other rank is idle.
    agents = [
        router.route(prepared(list(range(50_000 * n, 50_000 * n + 20_000)), rank=holder))
        for n in (1, 2, 3)
    ]
    for ticket in agents:
        ticket.first_token()
    # Counted in full they weigh 6,000 prompt tokens, more than the 4,000 the holder has cached;
    # counted up to the cap, 2,458.
    turn = router.route(prepared([*history, 1, 2, 3], "turn2"))
    assert (turn.decision.rank == holder) is stays
    for ticket in (*agents, turn):
        ticket.finished()


async def test_client_pin_is_honoured_and_counted(registry: CollectorRegistry) -> None:
    router = build_router(RoutingConfig(share_weight=0, decode_weight=0.1), registry)
    router.configure(engine_info((4, 5, 6)))
    ticket = router.route(prepared(list(range(64)), rank=6))
    assert ticket.decision.rank == 6
    assert ticket.decision.reason == "pinned"
    assert sample(registry, "rankgate_routing_in_flight_requests", rank="6") == 1
    assert sample(registry, "rankgate_routing_requests_total", policy="kv", rank="6") == 1
    ticket.first_token()
    # The pinned prompt now counts as cached on rank 6 for its next turn.
    follow = router.route(prepared([*range(64), 1, 2, 3, 4, 5]))
    assert follow.decision.rank == 6
    ticket.finished()
    assert sample(registry, "rankgate_routing_in_flight_requests", rank="6") == 1
    follow.finished()
    assert sample(registry, "rankgate_routing_in_flight_requests", rank="6") == 0
    # A pin the sidecar let through before the engine's ranks changed: retry, not a 400.
    with pytest.raises(EngineUnavailable, match="ranks changed"):
        router.route(prepared(list(range(64)), rank=3))


async def test_events_off_prediction_expires() -> None:
    now = [0.0]
    router = build_router(
        RoutingConfig(share_weight=0, predict_ttl=0.3), CollectorRegistry(), clock=lambda: now[0]
    )
    router.configure(engine_info((0, 1, 2, 3)))
    turn1 = list(range(500, 600))
    first = router.route(prepared(turn1, "t1"))
    first.finished()
    turn2 = router.route(prepared([*turn1, *range(600, 640)], "t2"))
    assert turn2.decision.rank == first.decision.rank
    assert turn2.decision.cached_tokens == 100
    turn2.finished()
    now[0] += 0.29
    assert router.route(prepared([*turn1, *range(600, 650)], "t2b")).decision.cached_tokens > 0
    now[0] += 0.4
    turn3 = router.route(prepared([*turn1, *range(600, 700)], "t3"))
    assert turn3.decision.cached_tokens == 0


async def test_a_decision_hashes_the_prompt_only_as_far_as_a_rank_holds_it(
    event_rig: RigFactory,
) -> None:
    rig = await event_rig(config=RoutingConfig(share_weight=0))
    router = rig.router
    assert isinstance(router, KvRouter)
    held = list(range(2000, 2000 + 40 * BLOCK))
    rig.publishers[1].publish([stored(list(range(40)), held, block_size=BLOCK)])
    await rig.settle(1, 1)

    # A prompt no rank holds: its first blocks decide it; the rest waits until it is sent.
    fresh = prepared(list(range(5000, 5000 + 60 * BLOCK)), "fresh")
    ticket = router.route(fresh)
    assert ticket.decision.cached_tokens == 0
    assert 0 < len(router.chain(fresh).hashes) < 60
    router.sent()
    assert router.chain(fresh).hashes == prompt_keys(fresh.prompt_token_ids, BLOCK).hashes
    ticket.finished()

    # A prompt whose 40-block prefix rank 1 holds: hashed past the prefix, not to its end,
    # and the whole prefix counted.
    longer = prepared([*held, *range(9000, 9000 + 40 * BLOCK)], "longer")
    ticket = router.route(longer)
    assert (ticket.decision.rank, ticket.decision.cached_tokens) == (1, 40 * BLOCK)
    assert 40 < len(router.chain(longer).hashes) < 80
    router.sent()
    assert len(router.chain(longer).hashes) == 80
    ticket.finished()

    # What the decisions left unhashed reached the predictions in full once sent: a third
    # prompt extending the fresh one finds all 60 of its blocks on the rank it went to.
    again = rig.route([*fresh.prompt_token_ids, *range(7000, 7008)])
    assert again[1] == 60 * BLOCK


async def test_ties_are_spread_by_first_block_not_rank_zero(event_rig: RigFactory) -> None:
    # Events on but silent, no bridging predictions, recent work not weighed: every rank costs
    # the same.
    config = RoutingConfig(share_weight=0, pending_ttl=0, recent_weight=0)
    router = (await event_rig((0, 1, 2, 3), config=config)).router
    ranks = set()
    for start in range(0, 4000, 100):
        ticket = router.route(prepared(list(range(start, start + 40)), f"p{start}"))
        ticket.finished()
        ranks.add(ticket.decision.rank)
        again = router.route(prepared(list(range(start, start + 40)), f"q{start}"))
        again.finished()
        assert again.decision.rank == ticket.decision.rank
    assert ranks == {0, 1, 2, 3}


async def test_images_fold_their_identity_into_the_blocks(event_rig: RigFactory) -> None:
    image_token = 99
    rig = await event_rig(
        config=RoutingConfig(share_weight=0, pending_ttl=0, image_token_id=image_token)
    )
    uuid_a = "a" * 64
    # Prompt as the engine saw it: 4 text tokens, the image expanded to 8 tokens, 4 text tokens.
    engine_tokens = [1, 2, 3, 4, *[image_token] * 8, 5, 6, 7, 8]
    keys = [None, [uuid_a], [uuid_a], None]
    rig.publishers[1].publish(
        [stored([11, 12, 13, 14], engine_tokens, block_size=BLOCK, extra_keys=keys)]
    )
    await rig.settle(1, 1)

    prompt = [1, 2, 3, 4, image_token, 5, 6, 7, 8, 9]
    same = (MediaInput(uuid=uuid_a, num_tokens=8),)
    assert rig.route(prompt, media=same) == (1, 16)
    other = (MediaInput(uuid="b" * 64, num_tokens=8),)
    assert rig.route(prompt, media=other)[1] == 4
    unknown_size = (MediaInput(uuid=uuid_a),)
    assert rig.route(prompt, media=unknown_size)[1] == 4


async def test_images_placed_by_the_request_need_no_token_id(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    uuid_a = "c" * 64
    engine_tokens = [1, 2, 3, 4, 5, 6, *[42] * 8, 7, 8]
    rig.publishers[0].publish(
        [
            stored(
                [21, 22, 23, 24],
                engine_tokens,
                block_size=BLOCK,
                extra_keys=[None, [[uuid_a, -2]], [[uuid_a, -2]], [[uuid_a, -2]]],
            )
        ]
    )
    await rig.settle(0, 1)
    prompt = [1, 2, 3, 4, 5, 6, 42, 7, 8, 9]
    assert rig.route(prompt, media=(MediaInput(uuid=uuid_a, num_tokens=8, position=6),)) == (0, 16)
    assert rig.route(prompt, media=(MediaInput(uuid=uuid_a, num_tokens=8),))[1] == 0


async def test_baselines() -> None:
    registry = CollectorRegistry()
    info = engine_info((0, 1, 2))
    rr = build_router(RoutingConfig(policy="round_robin"), registry)
    rr.configure(info)
    assert [rr.route(prepared([1, 2, 3])).decision.rank for _ in range(4)] == [0, 1, 2, 0]

    load = build_router(RoutingConfig(policy="load"), registry)
    load.configure(info)
    held = [load.route(prepared(list(range(200)), f"h{i}")) for i in range(3)]
    assert sorted(t.decision.rank or 0 for t in held) == [0, 1, 2]
    held[1].finished()
    assert load.route(prepared([1, 2, 3])).decision.rank == held[1].decision.rank

    engine = build_router(RoutingConfig(policy="engine"), registry)
    engine.configure(info)
    decision = engine.route(prepared([1, 2, 3])).decision
    assert decision.rank is None
    assert decision.header() == "rank=none;cached=0/0;policy=engine;reason="
    assert sample(registry, "rankgate_routing_requests_total", policy="engine", rank="none") == 1
    pinned = engine.route(prepared([1, 2, 3], rank=2)).decision
    assert (pinned.rank, pinned.reason) == (2, "pinned")
    assert sample(registry, "rankgate_routing_requests_total", policy="engine", rank="2") == 1


async def test_unconfigured_router_refuses() -> None:
    router = build_router(RoutingConfig(share_weight=0), CollectorRegistry())
    with pytest.raises(EngineUnavailable):
        router.route(prepared([1, 2, 3]))


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingConfig(policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_weight"):
        RoutingConfig(decode_weight=-1)
    with pytest.raises(ValueError, match="copy_weight"):
        RoutingConfig(copy_weight=-1)
    with pytest.raises(ValueError, match="decode_tokens_cap"):
        RoutingConfig(decode_tokens_cap=-1)
    with pytest.raises(ValueError, match="recent_weight"):
        RoutingConfig(recent_weight=-0.1)
    with pytest.raises(ValueError, match="recent_half_life"):
        RoutingConfig(recent_half_life=0)
    with pytest.raises(ValueError, match="prefill_weight"):
        RoutingConfig(prefill_weight=-0.5)
    with pytest.raises(ValueError, match="queue_weight"):
        RoutingConfig(queue_weight=-0.5)
    with pytest.raises(ValueError, match="image_token_id"):
        RoutingConfig(image_token_id=-1)
    with pytest.raises(ValueError, match="burst"):
        IntakeSettings(burst=0)
    with pytest.raises(ValueError, match="receive_hwm"):
        IntakeSettings(receive_hwm=0)
    with pytest.raises(ValueError, match="hot_spill"):
        RoutingConfig(hot_spill_requests=0)


async def test_metrics_exposition(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rig.publishers[0].publish([stored([1, 2, 3, 4], P, block_size=BLOCK)])
    await rig.settle(0, 1)
    ticket = rig.router.route(prepared(P + TAIL))
    registry = rig.registry
    assert sample(registry, "rankgate_routing_index_blocks", rank="0", medium="device") == 4
    assert sample(registry, "rankgate_routing_index_blocks", rank="1", medium="device") == 0
    assert sample(registry, "rankgate_routing_requests_total", policy="kv", rank="0") == 1
    assert sample(registry, "rankgate_routing_cached_tokens_total", rank="0") == 16
    assert sample(registry, "rankgate_routing_prompt_tokens_total", rank="0") == 17
    assert sample(registry, "rankgate_routing_in_flight_requests", rank="0") == 1
    text = generate_latest(registry).decode()
    for name in (
        "rankgate_kv_event_lag_seconds",
        "rankgate_routing_cached_prefix_ratio_bucket",
        "rankgate_routing_pending_prefill_tokens",
        "rankgate_routing_decode_tokens",
    ):
        assert name in text
    ticket.finished()
    assert sample(registry, "rankgate_routing_in_flight_requests", rank="0") == 0
