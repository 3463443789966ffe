"""KV-event intake through real ZMQ sockets in vLLM's exact frame format, checked through the
router's decisions (and its metrics for gaps, replays and purges)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.events import IntakeSettings
from rankgate.sidecar.routing.policies.kv import KvRouter
from tests.routing.conftest import BLOCK, EventRig, RigFactory, sample
from tests.routing.publisher import cleared, removed, stored
from tests.support.polling import until

# No bridging predictions: each probe sees exactly what the events announced.
PROBE = RoutingConfig(share_weight=0, pending_ttl=0)

P = list(range(1000, 1016))  # four blocks
msgpack_encoder = msgspec.msgpack.Encoder()
TAIL = [7]


def blocks(tokens: list[int], first: int, count: int) -> list[int]:
    return tokens[first * BLOCK : (first + count) * BLOCK]


async def test_longest_cached_prefix_wins(event_rig: RigFactory) -> None:
    rig: EventRig = await event_rig(config=PROBE)
    rank0, rank1 = rig.publishers
    rank0.publish([stored([11, 12], blocks(P, 0, 2), block_size=BLOCK)])
    rank1.publish([stored([21, 22, 23, 24], P, block_size=BLOCK)])
    await rig.settle(0, 1)
    await rig.settle(1, 1)

    assert rig.route(P + TAIL) == (1, 16)
    # Only the first two blocks asked: both hold them; the tie still reports the hit.
    rank, cached = rig.route([*blocks(P, 0, 2), 9, 9, 9, 9, 9])
    assert cached == 8
    assert rank in (0, 1)
    # Nothing shared: no credit anywhere.
    assert rig.route(list(range(5000, 5017)))[1] == 0


async def test_parent_links_chain_blocks_across_batches(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank0, rank1 = rig.publishers
    rank1.publish([stored([31], blocks(P, 0, 1), block_size=BLOCK)])
    rank1.publish([stored([32, 33], blocks(P, 1, 2), parent=31, block_size=BLOCK)])
    # A block whose parent the rank never announced cannot be placed in any chain.
    rank0.publish([stored([41, 42, 43], blocks(P, 1, 3), parent=999, block_size=BLOCK)])
    await rig.settle(1, 2)
    await rig.settle(0, 1)

    assert rig.route(P + TAIL) == (1, 12)
    rejected = sample(
        rig.registry, "rankgate_kv_event_rejected_total", rank="0", reason="unknown_parent"
    )
    assert rejected == 1


async def test_salt_and_lora_keep_caches_apart(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank0, rank1 = rig.publishers
    salted = [["rankgate-salt:tenant-a"], None, None, None]
    rank0.publish([stored([51, 52, 53, 54], P, block_size=BLOCK, extra_keys=salted)])
    adapter = [["sql"], ["sql"], ["sql"], ["sql"]]
    rank1.publish(
        [stored([61, 62, 63, 64], P, block_size=BLOCK, lora_name="sql", extra_keys=adapter)]
    )
    await rig.settle(0, 1)
    await rig.settle(1, 1)

    assert rig.route(P + TAIL)[1] == 0
    assert rig.route(P + TAIL, cache_salt="tenant-a") == (0, 16)
    assert rig.route(P + TAIL, cache_salt="tenant-b")[1] == 0
    assert rig.route(P + TAIL, lora_name="sql") == (1, 16)
    assert rig.route(P + TAIL, lora_name="sql", cache_salt="tenant-a")[1] == 0


async def test_removals_and_clears_are_applied(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank0, rank1 = rig.publishers
    rank0.publish([stored([71, 72, 73, 74], P, block_size=BLOCK)])
    rank1.publish([stored([81, 82], blocks(P, 0, 2), block_size=BLOCK)])
    await rig.settle(0, 1)
    await rig.settle(1, 1)
    assert rig.route(P + TAIL) == (0, 16)

    rank0.publish([removed([73])])
    await rig.settle(0, 2)
    assert rig.route(P + TAIL)[1] == 8

    rank1.publish([cleared()])
    await rig.settle(1, 2)
    assert rig.route(P + TAIL) == (0, 8)

    rank0.publish([removed([71])])
    await rig.settle(0, 3)
    assert rig.route(P + TAIL)[1] == 0


async def test_gap_is_filled_from_replay(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank0 = rig.publishers[0]
    rank0.publish([stored([91], blocks(P, 0, 1), block_size=BLOCK)])
    rank0.publish([stored([92], blocks(P, 1, 1), parent=91, block_size=BLOCK)], deliver=False)
    rank0.publish([stored([93], blocks(P, 2, 1), parent=92, block_size=BLOCK)])
    await rig.settle(0, 3)

    assert rank0.replay_requests == [1]
    assert rig.route(P + TAIL) == (0, 12)
    registry = rig.registry
    assert sample(registry, "rankgate_kv_event_gaps_total", rank="0") == 1
    assert sample(registry, "rankgate_kv_event_replays_total", rank="0", outcome="complete") == 1
    assert sample(registry, "rankgate_kv_event_batches_total", rank="0", origin="replay") == 2
    assert sample(registry, "rankgate_kv_event_sequence", rank="0") == 2
    assert sample(registry, "rankgate_kv_event_purges_total", rank="0", reason="replay") == 0


async def test_gap_without_replay_purges_the_rank(event_rig: RigFactory) -> None:
    rig = await event_rig(replay=False, config=PROBE)
    rank0 = rig.publishers[0]
    other = list(range(2000, 2016))
    rank0.publish([stored([101, 102, 103, 104], P, block_size=BLOCK)])
    await rig.settle(0, 1)
    assert rig.route(P + TAIL) == (0, 16)

    rank0.publish([stored([105], blocks(other, 0, 1), block_size=BLOCK)], deliver=False)
    rank0.publish([stored([106, 107], blocks(other, 0, 2), block_size=BLOCK)])
    await rig.settle(0, 2)

    assert rig.route(P + TAIL)[1] == 0
    assert rig.route(other + TAIL) == (0, 8)
    assert sample(rig.registry, "rankgate_kv_event_purges_total", rank="0", reason="gap") == 1


async def test_replay_that_cannot_cover_the_gap_purges(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank0 = rig.publishers[0]
    rank0.publish([stored([111, 112, 113, 114], P, block_size=BLOCK)])
    await rig.settle(0, 1)
    rank0.publish([removed([111, 112, 113, 114])], deliver=False)
    rank0.replay_floor = 2  # the publisher's buffer has rolled past the lost batch
    other = list(range(3000, 3016))
    rank0.publish([stored([115, 116], blocks(other, 0, 2), block_size=BLOCK)])
    await rig.settle(0, 2)

    # Without the purge the removed blocks would still attract this prompt.
    assert rig.route(P + TAIL)[1] == 0
    assert rig.route(other + TAIL) == (0, 8)
    registry = rig.registry
    assert sample(registry, "rankgate_kv_event_replays_total", rank="0", outcome="incomplete") == 1
    assert sample(registry, "rankgate_kv_event_purges_total", rank="0", reason="replay") == 1


async def test_publisher_restart_purges_and_rebuilds(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank0 = rig.publishers[0]
    rank0.publish([stored([121, 122, 123, 124], P, block_size=BLOCK)])
    rank0.publish([stored([125], [1, 2, 3, 4], block_size=BLOCK)])
    await rig.settle(0, 2)
    assert rig.route(P + TAIL) == (0, 16)

    fresh = list(range(4000, 4016))
    rank0.publish([stored([131, 132, 133], blocks(fresh, 0, 3), block_size=BLOCK)], seq=0)
    await rig.settle(0, 3)

    assert rig.route(P + TAIL)[1] == 0
    assert rig.route(fresh + TAIL) == (0, 12)
    assert sample(rig.registry, "rankgate_kv_event_purges_total", rank="0", reason="restart") == 1


async def test_late_subscriber_backfills_from_replay(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank1 = rig.publishers[1]
    # Published before this subscriber could see it: only the replay buffer has it.
    rank1.publish([stored([141, 142], blocks(P, 0, 2), block_size=BLOCK)], deliver=False)
    rank1.publish([stored([143, 144], blocks(P, 2, 2), parent=142, block_size=BLOCK)])
    await rig.settle(1, 2)

    assert rank1.replay_requests == [0]
    assert rig.route(P + TAIL) == (1, 16)


@pytest.mark.parametrize(
    ("batch_shape", "event_shape"),
    [("array", "map"), ("map", "map"), ("array", "array"), ("map", "array")],
)
async def test_both_envelope_and_event_shapes(
    event_rig: RigFactory, batch_shape: str, event_shape: str
) -> None:
    rig = await event_rig(config=PROBE)
    rank1 = rig.publishers[1]
    rank1.publish(
        [stored([151, 152, 153], blocks(P, 0, 3), block_size=BLOCK)],
        batch_shape=batch_shape,
        event_shape=event_shape,
    )
    await rig.settle(1, 1)
    assert rig.route(P + TAIL) == (1, 12)
    rank1.publish(
        [removed([153]), cleared()] if event_shape == "map" else [removed([152])],
        batch_shape=batch_shape,
        event_shape=event_shape,
    )
    await rig.settle(1, 2)
    expected = 0 if event_shape == "map" else 4
    assert rig.route(P + TAIL)[1] == expected


async def test_offloaded_blocks_count_partially(event_rig: RigFactory) -> None:
    rig = await event_rig(
        config=RoutingConfig(share_weight=0, pending_ttl=0, offloaded_hit_weight=0.5)
    )
    rank0, rank1 = rig.publishers
    rank0.publish([stored([161, 162, 163, 164], P, block_size=BLOCK, medium="CPU")])
    rank1.publish([stored([171], blocks(P, 0, 1), block_size=BLOCK)])
    await rig.settle(0, 1)
    await rig.settle(1, 1)
    # Four offloaded blocks at half credit beat one device block.
    assert rig.route(P + TAIL) == (0, 8)


async def test_bad_input_is_counted_and_skipped(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank0 = rig.publishers[0]
    rank0.send_raw([b"kv", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
    rank0.send_raw([b"kv", b"short", b""])
    rank0.seq = 1
    rank0.publish([stored([183], [1, 2], block_size=BLOCK * 2)])
    # An unknown event type is skipped; the batch is otherwise whole, so the rank's view is
    # trusted again after the block size it could not use.
    rank0.publish([{"type": "Mystery"}, stored([181, 182], blocks(P, 0, 2), block_size=BLOCK)])
    await rig.settle(0, 2)

    assert rig.route(P + TAIL) == (0, 8)
    registry = rig.registry
    for reason in ("batch", "frames", "event_type", "block_size"):
        assert sample(registry, "rankgate_kv_event_rejected_total", rank="0", reason=reason) == 1


async def test_subscriber_reconnects_to_a_restarted_publisher(event_rig: RigFactory) -> None:
    rig = await event_rig(config=PROBE)
    rank0 = rig.publishers[0]
    rank0.publish([stored([191, 192, 193, 194], P, block_size=BLOCK)])
    await rig.settle(0, 1)
    assert rig.route(P + TAIL) == (0, 16)

    # The engine process goes away and comes back on the same port, counting from 0 again.
    await asyncio.to_thread(rank0.rebind)
    fresh = list(range(6000, 6016))
    rank0.publish([stored([195, 196], blocks(fresh, 0, 2), block_size=BLOCK)])
    await rig.settle(0, 2)

    assert rig.route(P + TAIL)[1] == 0
    assert rig.route(fresh + TAIL) == (0, 8)
    assert sample(rig.registry, "rankgate_kv_event_purges_total", rank="0", reason="restart") == 1


async def test_batches_published_together_are_drained_in_one_turn(event_rig: RigFactory) -> None:
    rig = await event_rig(
        config=RoutingConfig(share_weight=0, pending_ttl=0, intake=IntakeSettings(coalesce=0.3))
    )
    rank0, rank1 = rig.publishers
    rank0.publish([stored([201], blocks(P, 0, 1), block_size=BLOCK)])
    await rig.settle(0, 1)
    # Published while the thread lets batches gather after its first wake-up.
    for n in range(2):
        rank0.publish([stored([202 + n], blocks(P, 1 + n, 1), parent=201 + n, block_size=BLOCK)])
        rank1.publish([stored([211 + n], blocks(P, n, 1), block_size=BLOCK)])
    await rig.settle(0, 3)
    await rig.settle(1, 2)

    assert rig.route(P + TAIL) == (0, 12)
    assert sample(rig.registry, "rankgate_kv_event_turns_total") <= 3


async def test_an_idle_intake_sleeps_until_it_is_stopped(event_rig: RigFactory) -> None:
    """No timer wakes the thread while nothing arrives and no deadline is due, and closing the
    router wakes it at once (a worker that polled would spend CPU doing nothing)."""
    rig = await event_rig(
        config=RoutingConfig(share_weight=0, pending_ttl=0, intake=IntakeSettings(coalesce=0))
    )

    def turns() -> float:
        return sample(rig.registry, "rankgate_kv_event_turns_total")

    rig.publishers[0].publish([stored([301], blocks(P, 0, 1), block_size=BLOCK)])
    await rig.settle(0, 1)
    await until(lambda: turns() == 1, 5, lambda: f"{turns()} turns for one batch")
    # No deadline is due, so the thread's next poll has no timeout: only a batch or the close
    # can end it.
    router = rig.intake_router
    assert isinstance(router, KvRouter)
    assert router.view.intake is not None
    assert router.view.intake._poll_timeout_ms() is None
    rig.publishers[1].publish([stored([302], blocks(P, 0, 1), block_size=BLOCK)])
    await rig.settle(1, 1)
    await until(lambda: turns() == 2, 5, lambda: f"{turns()} turns for two batches")

    started = time.monotonic()
    await rig.intake_router.close()
    assert time.monotonic() - started < 0.5


def _hostile_batches() -> list[bytes]:
    """Payloads a publisher, or anyone who reaches the socket, could send: each well-framed,
    none a usable EventBatch, and each of a shape that once could escape the decoder or the
    per-event checks (nesting past the decoder's depth, ext types, wrong container types,
    integers past 64 bits, unhashable ids)."""
    encode = msgpack_encoder.encode
    ext = msgspec.msgpack.Ext(5, b"x" * 8)
    huge = (1 << 64) - 1
    nested: object = []
    for _ in range(200):
        nested = [nested]
    bad_events = [
        {"type": "BlockStored", "block_hashes": [ext], "token_ids": P[:BLOCK], "block_size": BLOCK},
        {"type": "BlockStored", "block_hashes": [[{"a": 1}]], "token_ids": P[:BLOCK]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": {"a": 1}, "block_size": BLOCK},
        {"type": "BlockStored", "block_hashes": [2], "token_ids": [huge] * BLOCK},
        {"type": "BlockStored", "block_hashes": [3], "token_ids": [-(1 << 63)] * BLOCK},
        {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": {"x": 1}},
        {"type": "BlockStored", "block_hashes": [5], "token_ids": P[:BLOCK], "extra_keys": nested},
        {"type": "BlockStored", "block_hashes": [6], "token_ids": P[:BLOCK], "extra_keys": ext},
        {"type": "BlockStored", "block_hashes": [7], "block_size": "16", "lora_name": 7},
        {"type": "BlockStored", "block_hashes": "not a list", "medium": [1]},
        {"type": "BlockRemoved", "block_hashes": [{"a": 1}], "medium": {"m": 1}},
        {"type": "BlockRemoved", "block_hashes": 12},
        {"type": ["BlockStored"]},
        {"type": "AllBlocksCleared", "group_idx": [0]},
        ext,
        nested,
        "BlockStored",
        None,
    ]
    return [
        b"\x91" * 100_000 + b"\x90",  # an array nested 100,000 deep
        encode(ext),
        encode([ext, ext]),
        encode([huge, nested]),
        encode({"ts": ext, "events": {"not": "a list"}}),
        encode({"events": [[*["BlockStored"], *([nested] * 8)]]}),
        encode([float("nan"), bad_events]),
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion items, then nothing
    ]


async def test_no_batch_stops_the_intake(event_rig: RigFactory) -> None:
    rig: EventRig = await event_rig(config=PROBE)
    rank0 = rig.publishers[0]
    hostile = _hostile_batches()
    for number, payload in enumerate(hostile):
        rank0.send_raw([b"kv", number.to_bytes(8, "big"), payload])
    rank0.seq = len(hostile)
    rank0.publish([stored([201, 202, 203, 204], P, block_size=BLOCK)])
    # Hostile batches in a well-formed envelope count as applied too: the applied count cannot
    # tell when the good one is in, the route can.
    await until(
        lambda: rig.route(P + TAIL) == (0, 16),
        5,
        lambda: f"routed to {rig.route(P + TAIL)}",
    )
    registry = rig.registry
    rejected = sum(
        sample(registry, "rankgate_kv_event_rejected_total", rank="0", reason=reason)
        for reason in ("batch", "event", "event_type", "block_size", "unknown_parent")
    )
    assert rejected >= len(hostile)
    assert sample(registry, "rankgate_kv_intake_restarts_total") == 0
    assert sample(registry, "rankgate_kv_intake_up") == 1


async def test_an_intake_that_fails_anyway_restarts_with_its_view_purged(
    event_rig: RigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig: EventRig = await event_rig(config=PROBE)
    rank0 = rig.publishers[0]
    rank0.publish([stored([211, 212, 213, 214], P, block_size=BLOCK)])
    await rig.settle(0, 1)
    assert rig.route(P + TAIL) == (0, 16)

    intake = rig.intake_router.view.intake  # type: ignore[attr-defined]
    serve_live = intake._drain_live
    failures = [RuntimeError("a fault nobody foresaw")]

    def failing(feed: object) -> None:
        if failures:
            raise failures.pop()
        serve_live(feed)

    monkeypatch.setattr(intake, "_drain_live", failing)
    rank0.publish([stored([215], list(range(7000, 7016)), block_size=BLOCK)])
    registry = rig.registry
    await until(
        lambda: sample(registry, "rankgate_kv_intake_restarts_total") == 1,
        5,
        "the intake restarted once",
    )
    # Events may have been lost while it was down: the rank's view is not trusted.
    assert sample(registry, "rankgate_kv_event_purges_total", rank="0", reason="intake_restart")
    assert rig.route(P + TAIL)[1] == 0
    await until(
        lambda: sample(registry, "rankgate_kv_intake_up") == 1,
        5,
        "the intake up again",
    )
    # Serving again: a restarted publisher's events are taken in as before.
    await asyncio.to_thread(rank0.rebind)
    rank0.publish([stored([216, 217, 218, 219], P, block_size=BLOCK)])
    await until(
        lambda: rig.route(P + TAIL) == (0, 16),
        5,
        lambda: f"routed to {rig.route(P + TAIL)}",
    )
    assert intake.running
