"""The orchestrator itself against two mock engines: cancellation at each phase, the hand-off's
timeout bound, shutdown pre-empting it, startup checks and readiness.

The mock decode role counts a *stranded* transfer whenever its stream is dropped before the
first token, the hazard the hand-off exists to prevent; ``leaked`` counts requests it still
tracks but no longer schedules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from rankgate.sidecar.admission import Admission, AdmissionConfig
from rankgate.sidecar.config import DisaggConfig, SidecarConfig
from rankgate.sidecar.disagg import DisaggregatedEngine, learned_media, routing_for
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.errors import DiscoveryError, EngineUnavailable, InvalidRequest
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.types import (
    Delta,
    MediaInput,
    PreparedRequest,
    SamplingParams,
    StoppingParams,
)
from tests.disagg.conftest import Pair, engine_config, engine_pair
from tests.support.mock_engine import running_mock_engine
from tests.support.polling import until

# Slow enough to cancel inside each phase on a busy machine: a 200-token prompt prefills for
# about 2 s, and a decode waits the configured transfer time for its KV.
SLOW_PREFILL = {"prefill_seconds_per_token": 10e-3}


def remote_pd(prefill: Sidecar, decode: Sidecar) -> DisaggregatedEngine:
    """Every prompt prefilled on the prefill engine: the path these tests are about."""
    return DisaggregatedEngine(prefill, decode, DisaggConfig(prefill_mode="remote"))


def sidecar(endpoint: str, admission: Admission | None = None, **config: Any) -> Sidecar:
    settings: dict[str, Any] = {
        "endpoint": endpoint,
        "startup_timeout": 10.0,
        "retry_interval": 0.05,
        "health_interval": 0.05,
    }
    settings.update(config)
    router = build_router(routing_for(RoutingConfig()), CollectorRegistry())
    return Sidecar(SidecarConfig(**settings), router, admission)


@asynccontextmanager
async def disaggregated(pair: Pair, **config: Any) -> AsyncIterator[DisaggregatedEngine]:
    engine = remote_pd(sidecar(pair.prefill.target), sidecar(pair.decode.target, **config))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


def prepared(
    rid: str, prompt_len: int = 40, max_tokens: int = 200, **fields: Any
) -> PreparedRequest:
    # Distinct per request id, so no prompt is served from a prefix cache.
    base = sum(map(ord, rid)) % 500
    return PreparedRequest(
        request_id=rid,
        prompt_token_ids=tuple(100 + (base + i * 7) % 3000 for i in range(prompt_len)),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


async def consume(stream: AsyncIterator[Delta], deltas: list[Delta]) -> None:
    """Collect into ``deltas`` as they come, so a test sees them while the stream runs."""
    async for delta in stream:
        deltas.append(delta)  # noqa: PERF401


def assert_clean(pair: Pair, stranded: int = 0) -> None:
    prefill, decode = pair.totals("prefill"), pair.totals("decode")
    assert (prefill.active, decode.active) == (0, 0)
    assert (prefill.leaked, decode.leaked) == (0, 0)
    assert prefill.stranded_transfers == 0
    assert decode.stranded_transfers == stranded
    # A stranded transfer leaves its prefill's KV held until the lease ends.
    assert (prefill.held_transfers, prefill.leases_expired) == (stranded, 0)


async def round_trip(side: Sidecar) -> None:
    """A request through ``side``'s connection that its engine refuses at once: what the
    connection carried before it (a dropped stream) has reached the engine when it returns."""
    unsigned = prepared("probe", 4, 1, kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(InvalidRequest, match="no transfer_digest"):
        await consume(side.generate(unsigned), [])


async def abort_lost(request_ids: object) -> None:
    """A ``Sidecar.abort`` whose Abort lands after the engine finished the prefill."""


async def leave_during_prefill(engine: DisaggregatedEngine, pair: Pair, rid: str) -> None:
    """A client that leaves while the prefill of its 200-token prompt runs."""
    task = asyncio.ensure_future(consume(engine.generate(prepared(rid, 200)), []))
    await until(
        lambda: pair.totals("prefill").running == 1,
        10,
        lambda: f"{pair.totals('prefill').running} running on the prefill engine",
    )
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_during_prefill_drops_it_at_once_and_sends_no_decode() -> None:
    with engine_pair(prefill=SLOW_PREFILL) as pair:
        async with disaggregated(pair) as engine:
            deltas: list[Delta] = []
            task = asyncio.ensure_future(consume(engine.generate(prepared("p", 200)), deltas))
            await until(
                lambda: pair.totals("prefill").running == 1,
                10,
                lambda: f"{pair.totals('prefill').running} running on the prefill engine",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Dropped at once: well before the two-second prefill could have finished.
            await until(pair.idle, 1.0, "the pair idle")
            prefill = pair.totals("prefill")
            assert (prefill.aborts, prefill.requests_served) == (1, 0)
            assert pair.totals("decode").requests_received == 0
            assert deltas == []
            assert_clean(pair)


async def test_a_prefill_that_finishes_as_its_client_leaves_has_its_kv_read_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Abort of a prefill can land after the engine finished it: the engine then holds
    the prompt's KV for a decode. Here every Abort is lost on the way, so the prefill always
    runs to its end; the decode side must read the KV (one token) so that the prefill side
    frees it now, not when its lease ends."""
    with engine_pair(prefill=SLOW_PREFILL) as pair:
        prefill = sidecar(pair.prefill.target)
        monkeypatch.setattr(prefill, "abort", abort_lost)
        engine = remote_pd(prefill, sidecar(pair.decode.target))
        await engine.start()
        try:
            await leave_during_prefill(engine, pair, "late")
            await until(
                lambda: pair.totals("prefill").transfers_released == 1,
                10,
                lambda: f"{pair.totals('prefill').transfers_released} transfers released",
            )
            await until(pair.idle, 10, "the pair idle")
            served, decode = pair.totals("prefill"), pair.totals("decode")
            assert (served.requests_served, served.aborts) == (1, 0)
            assert decode.requests_received == 1
            assert decode.generated_tokens <= 1
            assert_clean(pair)
        finally:
            await engine.close()


async def test_a_finished_prefill_whose_kv_cannot_be_handed_off_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode side is gone when the late prefill ends: its KV waits out the lease, the
    gateway says so, and nothing else fails (the client's cancellation stays a cancellation)."""

    def gone(request: PreparedRequest, trusted_until: float | None = None) -> None:
        raise EngineUnavailable("decode engine: not serving")

    with engine_pair(prefill=SLOW_PREFILL) as pair:
        prefill, decode = sidecar(pair.prefill.target), sidecar(pair.decode.target)
        monkeypatch.setattr(prefill, "abort", abort_lost)
        monkeypatch.setattr(decode, "hand_off_kv", gone)
        engine = remote_pd(prefill, decode)
        await engine.start()
        try:
            await leave_during_prefill(engine, pair, "gone")
            await until(
                lambda: "could not hand off the KV of gone" in caplog.text,
                10,
                "the failed hand-off is logged",
            )
            assert pair.totals("prefill").held_transfers == 1
            assert pair.totals("decode").requests_received == 0
        finally:
            await engine.close()


async def test_a_prefill_cancelled_while_it_waits_for_a_slot_is_never_sent() -> None:
    with engine_pair(prefill=SLOW_PREFILL) as pair:
        one_slot = Admission(AdmissionConfig(per_rank=1))
        engine = remote_pd(
            sidecar(pair.prefill.target, admission=one_slot), sidecar(pair.decode.target)
        )
        await engine.start()
        try:
            # One slot per rank: two prefills fill both, the third waits.
            running = [
                asyncio.ensure_future(consume(engine.generate(prepared(rid, 200)), []))
                for rid in ("a", "b")
            ]
            await until(
                lambda: pair.totals("prefill").running == 2,
                10,
                lambda: f"{pair.totals('prefill').running} running on the prefill engine",
            )
            waiting = asyncio.ensure_future(consume(engine.generate(prepared("c", 200)), []))
            await until(
                lambda: one_slot.waiting == 1,
                10,
                lambda: f"{one_slot.waiting} waiting for the slot",
            )
            for task in (waiting, *running):
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await until(pair.idle, 10, "the pair idle")
            prefill = pair.totals("prefill")
            assert (prefill.requests_received, prefill.aborts) == (2, 2)
            assert pair.totals("decode").requests_received == 0
            assert one_slot.in_use == 0
            assert_clean(pair)
        finally:
            await engine.close()


async def test_cancel_after_decode_submission_drains_until_the_first_token() -> None:
    with engine_pair(decode={"kv_transfer_seconds": 0.8}) as pair:
        decode_side = sidecar(pair.decode.target)
        engine = remote_pd(sidecar(pair.prefill.target), decode_side)
        await engine.start()
        try:
            task = asyncio.ensure_future(consume(engine.generate(prepared("d")), []))
            await until(
                lambda: pair.totals("decode").transferring == 1,
                10,
                lambda: f"{pair.totals('decode').transferring} transferring on the decode engine",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await round_trip(decode_side)
            # The client is gone, but the transfer is still running and the stream attached.
            decode = pair.totals("decode")
            assert (decode.transferring, decode.active) == (1, 1)
            await until(pair.idle, 10, "the pair idle")
            decode = pair.totals("decode")
            assert decode.transfers_completed == 1
            assert decode.generated_tokens >= 1
            # Dropped right after its first token: aborted, not served to the end.
            assert (decode.aborts, decode.requests_served) == (1, 0)
            assert_clean(pair)
        finally:
            await engine.close()


async def test_cancel_after_the_first_token_drops_the_decode_at_once() -> None:
    with engine_pair(decode={"decode_step_seconds": 0.05}) as pair:
        async with disaggregated(pair) as engine:
            deltas: list[Delta] = []
            task = asyncio.ensure_future(consume(engine.generate(prepared("f")), deltas))
            await until(lambda: len(deltas) >= 2, 10, lambda: f"{len(deltas)} deltas")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(pair.idle, 1.0, "the pair idle")
            decode = pair.totals("decode")
            assert (decode.aborts, decode.requests_served) == (1, 0)
            assert decode.generated_tokens < 200
            assert_clean(pair)


async def test_a_client_gone_with_its_seeded_first_token_has_its_kv_read_at_once() -> None:
    """The seeded first token reaches the client before the decode is sent: a client that
    leaves right then must not leave the prefill's KV held until its lease ends."""
    with engine_pair() as pair:
        async with disaggregated(pair) as engine:
            stream = engine.generate(prepared("seeded-then-gone"))
            first = await anext(stream)
            assert first.token_ids, "the prefill's own first token, seeded"
            assert pair.totals("decode").requests_received == 0
            await stream.aclose()
            await until(
                lambda: pair.totals("prefill").transfers_released == 1,
                10,
                lambda: f"{pair.totals('prefill').transfers_released} transfers released",
            )
            await until(pair.idle, 10, "the pair idle")
            assert pair.totals("decode").generated_tokens <= 1
            assert_clean(pair)


async def test_the_hand_off_drain_is_bounded_by_its_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rankgate.sidecar")
    with engine_pair(decode={"kv_transfer_seconds": 30.0}) as pair:
        async with disaggregated(pair, decode_handoff_timeout=0.5) as engine:
            task = asyncio.ensure_future(consume(engine.generate(prepared("t")), []))
            await until(
                lambda: pair.totals("decode").transferring == 1,
                10,
                lambda: f"{pair.totals('decode').transferring} transferring on the decode engine",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(pair.idle, 10, "the pair idle")
            # Dropped by the bound, not by the client leaving.
            assert (
                "decode request t-0 had no first token 0.5 s after its client left" in caplog.text
            )
            # The bound chose to drop a transfer that would not finish: the hazard, counted.
            assert_clean(pair, stranded=1)


async def test_shutdown_pre_empts_the_hand_off_drain() -> None:
    with engine_pair(decode={"kv_transfer_seconds": 30.0}) as pair:
        decode_side = sidecar(pair.decode.target)
        engine = remote_pd(sidecar(pair.prefill.target), decode_side)
        await engine.start()
        try:
            task = asyncio.ensure_future(consume(engine.generate(prepared("s")), []))
            await until(
                lambda: pair.totals("decode").transferring == 1,
                10,
                lambda: f"{pair.totals('decode').transferring} transferring on the decode engine",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await round_trip(decode_side)
            assert pair.totals("decode").active == 1
        finally:
            loop = asyncio.get_running_loop()
            start = loop.time()
            await engine.close()
            assert loop.time() - start < 3.0
        await until(pair.idle, 3.0, "the pair idle")
        assert not engine.ready
        with pytest.raises(EngineUnavailable, match="prefill engine: the gateway is shutting down"):
            _ = engine.info


async def test_a_hundred_random_cancellations_strand_and_leak_nothing() -> None:
    """Clients leave at random points of every phase; the drain leaves engines clean."""
    rng = random.Random(8)
    with engine_pair(decode={"kv_transfer_seconds": 0.2}) as pair:
        async with disaggregated(pair) as engine:

            async def one(i: int) -> None:
                task = asyncio.ensure_future(
                    consume(engine.generate(prepared(f"r{i}", 20 + i % 40, 30)), [])
                )
                await asyncio.sleep(rng.uniform(0.0, 0.6))
                task.cancel()  # some have finished by then: that is fine too
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            await asyncio.gather(*(one(i) for i in range(100)))
            await until(pair.idle, 20, "the pair idle")
            assert_clean(pair)
            decode = pair.totals("decode")
            # Every decode that was sent got its KV, though most clients left before that.
            assert 0 < decode.transfers_completed == decode.requests_received
            assert decode.aborts > 0


async def test_each_side_holds_an_admission_slot_only_while_its_phase_runs() -> None:
    """A prefill slot while the prefill runs, a decode slot until the decode ends (through
    the hand-off drain after a client left); every slot back on both sides afterwards."""
    rng = random.Random(10)
    with engine_pair(decode={"kv_transfer_seconds": 0.5}) as pair:
        prefill, decode = sidecar(pair.prefill.target), sidecar(pair.decode.target)
        engine = remote_pd(prefill, decode)
        await engine.start()
        try:
            assert engine.admission is decode.admission
            task = asyncio.ensure_future(consume(engine.generate(prepared("h")), []))
            await until(
                lambda: pair.totals("decode").transferring == 1,
                10,
                lambda: f"{pair.totals('decode').transferring} transferring on the decode engine",
            )
            assert (prefill.admission.in_use, decode.admission.in_use) == (0, 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The client left; the hand-off drain still holds the decode's slot.
            assert decode.admission.in_use == 1
            await until(
                lambda: decode.admission.in_use == 0,
                10,
                lambda: f"{decode.admission.in_use} decode slots in use",
            )

            async def one(i: int) -> None:
                task = asyncio.ensure_future(
                    consume(engine.generate(prepared(f"a{i}", 20 + i % 30, 20, n=1 + i % 2)), [])
                )
                await asyncio.sleep(rng.uniform(0.0, 0.8))
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            await asyncio.gather(*(one(i) for i in range(30)))
            await until(pair.idle, 20, "the pair idle")
            await until(
                lambda: prefill.admission.in_use + decode.admission.in_use == 0,
                10,
                lambda: f"in use: {prefill.admission.in_use} + {decode.admission.in_use}",
            )
            assert (prefill.admission.waiting, decode.admission.waiting) == (0, 0)
            assert_clean(pair)
        finally:
            await engine.close()


async def test_startup_refuses_engines_serving_different_models() -> None:
    with (
        running_mock_engine(engine_config("prefill", model="model-a")) as prefill,
        running_mock_engine(engine_config("decode", model="model-b")) as decode,
    ):
        engine = remote_pd(sidecar(prefill.target), sidecar(decode.target))
        with pytest.raises(DiscoveryError) as caught:
            await engine.start()
        assert "'model-a'" in caught.value.message
        assert "'model-b'" in caught.value.message
        assert not engine.ready


async def test_startup_names_the_side_that_is_not_there() -> None:
    with running_mock_engine(engine_config("prefill")) as prefill:
        engine = remote_pd(
            sidecar(prefill.target),
            sidecar("127.0.0.1:9", startup_timeout=0.5),
        )
        with pytest.raises(EngineUnavailable, match=r"^decode engine: "):
            await engine.start()
        assert not engine.ready


async def test_readiness_needs_both_sides() -> None:
    with engine_pair() as pair:
        async with disaggregated(pair) as engine:
            assert engine.ready
            pair.decode.faults.set_serving(False)
            await until(lambda: not engine.ready, 10, "the engine stops being ready")
            with pytest.raises(EngineUnavailable, match=r"^decode engine: "):
                await consume(engine.generate(prepared("x")), [])
            assert pair.totals("prefill").requests_received == 0
            pair.decode.faults.set_serving(True)
            await until(lambda: engine.ready, 10, "the engine is ready again")
            deltas: list[Delta] = []
            await consume(engine.generate(prepared("y", max_tokens=3)), deltas)
            assert deltas[-1].finish_reason == "length"


def test_learned_media_fills_the_one_unknown_image() -> None:
    known = MediaInput(uuid="a" * 64, num_tokens=6)
    unknown = MediaInput(uuid="b" * 64)
    # 10 prompt tokens with 2 placeholders; expanded to 8 text tokens + 6 + 12 image tokens.
    filled = learned_media((known, unknown), 10, 26)
    assert [item.num_tokens for item in filled] == [6, 12]
    assert learned_media((unknown, unknown), 10, 26) == (unknown, unknown)
    assert learned_media((unknown,), 10, 0) == (unknown,)
