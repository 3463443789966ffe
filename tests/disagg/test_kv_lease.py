"""The KV-trust watchdog: a decode that cannot have read its prefill's KV before the prefill
engine's lease may end is never answered from that KV.

The mock mirrors vLLM's hazard: a decode engine that reads a prefill's KV after the lease
ended answers without an error, from whatever the blocks hold then (unrelated tokens), and
counts an ``expired_read``. The prefill engine's lease is shortened to a second here.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from rankgate.sidecar.admission import Admission, AdmissionConfig
from rankgate.sidecar.config import DisaggConfig
from rankgate.sidecar.disagg import DisaggregatedEngine
from rankgate.sidecar.disagg_metrics import DisaggMetrics
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.types import Delta
from tests.disagg.conftest import engine_pair
from tests.disagg.test_engine import consume, prepared, sidecar
from tests.support.polling import until

LEASE = 1.0
SHORT_LEASE = {"kv_lease_seconds": LEASE}
# A decode engine whose KV pull takes longer than the lease (a congested link, say).
SLOW_PULL = {"kv_transfer_seconds": 2.5 * LEASE}


def split(
    prefill: Sidecar, decode: Sidecar, lease: float, registry: CollectorRegistry
) -> DisaggregatedEngine:
    config = DisaggConfig(prefill_mode="remote", kv_lease=lease)
    return DisaggregatedEngine(prefill, decode, config, DisaggMetrics(registry))


def tokens(deltas: list[Delta]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def local_answer(decode_target: str, rid: str) -> list[int]:
    """What the decode engine answers when it prefills the prompt itself."""
    engine = sidecar(decode_target)
    await engine.start()
    try:
        deltas: list[Delta] = []
        await consume(engine.generate(prepared(rid, 60, 12)), deltas)
        return tokens(deltas)
    finally:
        await engine.close()


async def test_the_mock_answers_from_garbage_when_its_read_comes_after_the_lease() -> None:
    """The hazard itself: with a gateway that trusts the KV too long, the late read returns
    tokens that do not follow the prompt, and nothing says so but the engine's counters."""
    registry = CollectorRegistry()
    with engine_pair(prefill=SHORT_LEASE, decode=SLOW_PULL) as pair:
        expected = await local_answer(pair.decode.target, "g")
        engine = split(sidecar(pair.prefill.target), sidecar(pair.decode.target), 60.0, registry)
        await engine.start()
        try:
            deltas: list[Delta] = []
            await consume(engine.generate(prepared("g", 60, 12)), deltas)
        finally:
            await engine.close()
        assert deltas[-1].finish_reason == "length"
        assert tokens(deltas) != expected
        assert pair.totals("decode").expired_reads == 1
        assert pair.totals("prefill").leases_expired == 1


async def test_a_decode_not_started_within_the_lease_is_prefilled_again_locally() -> None:
    registry = CollectorRegistry()
    with engine_pair(prefill=SHORT_LEASE, decode=SLOW_PULL) as pair:
        expected = await local_answer(pair.decode.target, "w")
        engine = split(sidecar(pair.prefill.target), sidecar(pair.decode.target), LEASE, registry)
        await engine.start()
        try:
            deltas: list[Delta] = []
            await consume(engine.generate(prepared("w", 60, 12)), deltas)
            # The answer is the decode engine's own prefill of the prompt, not the late read.
            assert tokens(deltas) == expected
            assert deltas[-1].finish_reason == "length"
            assert sample(registry, "rankgate_pd_kv_lease_missed_total", stage="sent") == 1
            # The given-up decode is still read to its first token (so no stream is cut
            # mid-transfer) and dropped; its garbage reaches no one.
            await until(pair.idle, 10, "the pair idle")
            decode = pair.totals("decode")
            assert decode.expired_reads == 1
            assert decode.requests_received == 3  # the reference answer, the late decode, the retry
            waited = sample(registry, "rankgate_pd_kv_wait_seconds_count")
            assert waited == 1
        finally:
            await engine.close()


async def test_a_decode_still_waiting_for_a_slot_when_the_lease_can_end_is_never_sent() -> None:
    """Every decode slot is busy past the lease: the decode carrying the prefill's params is
    not sent at all (nor handed off), and the prompt is prefilled on the decode engine once a
    slot frees."""
    registry = CollectorRegistry()
    with engine_pair(prefill=SHORT_LEASE) as pair:
        expected = await local_answer(pair.decode.target, "q")
        decode = sidecar(pair.decode.target, Admission(AdmissionConfig(per_rank=1)))
        engine = split(sidecar(pair.prefill.target), decode, LEASE, registry)
        before = pair.totals("decode").requests_received
        await engine.start()
        try:
            ranks = decode.info.ranks
            async with decode.admission.grant(None, len(ranks), 0) as held:
                keys = [held.take(rank) for rank in ranks]
            deltas: list[Delta] = []
            task = asyncio.ensure_future(consume(engine.generate(prepared("q", 60, 12)), deltas))
            await until(
                lambda: sample(registry, "rankgate_pd_kv_lease_missed_total", stage="queued") == 1,
                10,
                "the queued decode misses its lease",
            )
            assert pair.totals("decode").requests_received == before
            for key in keys:
                assert key is not None
                decode.admission.give(key)
            await task
            assert tokens(deltas) == expected
            await until(pair.idle, 10, "the pair idle")
            # One request on the decode engine: the local prefill. The KV's lease ran out
            # on the prefill side, and nothing read it late.
            assert pair.totals("decode").requests_received == before + 1
            assert pair.totals("decode").expired_reads == 0
            assert pair.totals("prefill").leases_expired == 1
        finally:
            await engine.close()


async def test_a_decode_that_starts_in_time_is_answered_from_the_transfer() -> None:
    registry = CollectorRegistry()
    with engine_pair(prefill=SHORT_LEASE) as pair:
        engine = split(sidecar(pair.prefill.target), sidecar(pair.decode.target), LEASE, registry)
        await engine.start()
        try:
            deltas: list[Delta] = []
            await consume(engine.generate(prepared("t", 60, 12)), deltas)
            assert len(tokens(deltas)) == 12
            assert sample(registry, "rankgate_pd_kv_lease_missed_total", stage="sent") == 0
            assert sample(registry, "rankgate_pd_kv_lease_missed_total", stage="queued") == 0
            assert sample(registry, "rankgate_pd_kv_wait_seconds_count") == 1
            await until(pair.idle, 10, "the pair idle")
            assert pair.totals("decode").requests_received == 1
            assert pair.totals("prefill").transfers_released == 1
        finally:
            await engine.close()
