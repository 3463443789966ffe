"""Engine faults injected in the mock vLLM, observed through the gateway's HTTP surface.

Each test checks what a client sees (a complete answer, or one clean error: an SSE error
event and a single ``[DONE]``, or a 4xx/5xx with Retry-After), that nothing hangs past its
timeout, that no engine request leaks and every in-flight count returns to zero, and that the
gateway serves again afterwards.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rankgate.sidecar.routing.config import RoutingConfig
from tests.chaos.harness import (
    Gateway,
    StreamResult,
    assert_clean,
    chat,
    engine_config,
    gateway,
    mock_engine,
    refuse_on_rank,
    stream,
)
from tests.support.mock_engine import running_mock_engine
from tests.support.polling import wait_until

pytestmark = pytest.mark.timeout(60)


def test_engine_death_mid_stream_ends_every_stream_with_one_error_event() -> None:
    with mock_engine(speed=1.0) as handle, gateway(handle) as gw:
        handle.faults.kill_after_tokens(20)
        with ThreadPoolExecutor(6) as pool:
            futures = [
                pool.submit(stream, gw.http, chat(f"victim {i}", max_tokens=400)) for i in range(6)
            ]
            results: list[StreamResult] = [f.result(timeout=30) for f in futures]
        for result in results:
            if result.status == 200:
                assert result.done == 1, "exactly one [DONE] per stream"
                assert result.error is not None, "a stream cut by the engine must say so"
                assert result.error["code"] in ("engine_failure", "engine_unavailable")
                assert result.finish is None, "no invented finish after an engine death"
            else:
                assert result.status in (500, 503)
        assert any(r.status == 200 for r in results), "some streams were running when it died"
        wait_until(lambda: gw.http.get("/ready").status_code == 503, 5, "readiness drops")
        refused = gw.http.post("/v1/chat/completions", json=chat(max_tokens=4))
        assert refused.status_code == 503
        assert "retry-after" in refused.headers
        handle.faults.kill_after_tokens(10**9)
        handle.faults.revive_engine()
        assert_clean(handle, gw)


def test_health_flapping_answers_cleanly_and_settles() -> None:
    with mock_engine(speed=0.0) as handle, gateway(handle) as gw:
        handle.faults.flap_health(0.03, 10)
        statuses: list[int] = []
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            response = gw.http.post("/v1/chat/completions", json=chat(max_tokens=8))
            statuses.append(response.status_code)
            if response.status_code == 200:
                assert response.json()["choices"][0]["finish_reason"] == "length"
            else:
                assert response.status_code == 503, response.text
                assert "retry-after" in response.headers
        assert 200 in statuses
        assert_clean(handle, gw)


def test_slow_start_is_waited_for_then_served() -> None:
    began = time.monotonic()
    with mock_engine(startup_delay_s=1.5) as handle, gateway(handle) as gw:
        assert time.monotonic() - began >= 1.4
        assert gw.http.get("/ready").status_code == 200
        assert_clean(handle, gw)


def test_restart_with_a_different_model_is_refused_loudly_then_restored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = engine_config(speed=0.0)
    first = running_mock_engine(config)
    handle = first.__enter__()
    try:
        with gateway(handle) as gw:
            assert gw.http.post("/v1/chat/completions", json=chat(max_tokens=2)).is_success
            first.__exit__(None, None, None)
            wait_until(lambda: gw.http.get("/ready").status_code == 503, 5, "engine gone noticed")
            with mock_engine(config, model="impostor-llm"):
                wait_until(lambda: "changed since startup" in _problem(gw), 15, "drift noticed")
                refused = gw.http.post("/v1/chat/completions", json=chat(max_tokens=2))
                assert refused.status_code == 503
                message = refused.json()["error"]["message"]
                assert "impostor-llm" in message
                assert gw.http.get("/ready").status_code == 503
            with mock_engine(config) as restored:
                wait_until(lambda: gw.http.get("/ready").status_code == 200, 15, "restored")
                assert_clean(restored, gw)
    finally:
        first.__exit__(None, None, None)
    assert any(
        r.levelname == "ERROR" and "changed since startup" in r.getMessage() for r in caplog.records
    )


def _problem(gw: Gateway) -> str:
    response = gw.http.post("/v1/chat/completions", json=chat(max_tokens=2))
    if response.status_code == 200:
        return ""
    return str(response.json()["error"]["message"])


def test_rank_local_refusal_is_retried_on_another_rank_before_the_first_byte() -> None:
    with mock_engine(speed=0.0) as handle, gateway(handle, policy="round_robin") as gw:
        refuse_on_rank(handle, 1)
        before = handle.all_stats()
        for i in range(8):
            body = chat(f"retry me {i}", max_tokens=6)
            if i % 2:
                result = stream(gw.http, body)
                assert result.status == 200
                assert result.error is None
                assert result.done == 1
                assert result.finish == "length"
            else:
                response = gw.http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
        after = handle.all_stats()
        assert after[1].requests_received == before[1].requests_received
        assert after[0].requests_served - before[0].requests_served == 8
        assert gw.sidecar().retries >= 4
        pinned = gw.http.post(
            "/v1/chat/completions", json=chat(max_tokens=2), headers={"x-data-parallel-rank": "1"}
        )
        assert pinned.status_code == 429, "a rank the client pinned is not silently replaced"
        assert "retry-after" in pinned.headers
        refuse_on_rank(handle, 1, 0)
        assert_clean(handle, gw)


def test_refusals_everywhere_are_retried_a_bounded_number_of_times_then_429() -> None:
    with mock_engine(speed=0.0, dp_size=4) as handle, gateway(handle, policy="load") as gw:
        for rank in range(4):
            refuse_on_rank(handle, rank)
        retries = gw.sidecar().retries
        response = gw.http.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert response.status_code == 429
        assert "retry-after" in response.headers
        assert gw.sidecar().retries - retries == 2
        for rank in range(4):
            refuse_on_rank(handle, rank, 0)
        assert_clean(handle, gw)


def test_engine_overload_is_429_with_retry_after_and_nothing_is_lost() -> None:
    with mock_engine(speed=0.0) as handle, gateway(handle) as gw:
        handle.faults.reject_requests(3)
        codes = [
            gw.http.post("/v1/chat/completions", json=chat(max_tokens=2)).status_code
            for _ in range(5)
        ]
        assert codes.count(200) >= 2
        assert set(codes) <= {200, 429}
        assert_clean(handle, gw)


def test_model_name_is_checked_before_the_engine_sees_anything() -> None:
    with mock_engine(speed=0.0) as handle, gateway(handle) as gw:
        before = handle.all_stats()
        response = gw.http.post("/v1/chat/completions", json={**chat(), "model": "nope"})
        assert response.status_code == 404
        assert handle.all_stats() == before


@pytest.mark.parametrize("fault", ["drop", "restart"])
def test_kv_event_loss_is_recovered_and_routing_follows_the_cache(fault: str) -> None:
    """Batches lost on the wire (a sequence gap, refilled from replay) or a publisher restart
    (sequence back to 0): the prefix index must still learn where a prefix lives. Predictions
    are off, so only the KV events can tell the router where the prefix is (and the share term,
    which the pinned requests would tip, is off)."""
    events_only = RoutingConfig(pending_ttl=0.0, share_weight=0.0)
    with mock_engine(speed=0.0) as handle, gateway(handle, routing=events_only) as gw:
        prefix = " ".join(f"alpha{i} beta{i}" for i in range(60))
        other = " ".join(f"gamma{i}" for i in range(60))
        if fault == "drop":
            handle.faults.drop_kv_batches(1, rank=1)
        else:
            for word in ("delta", "epsilon", "zeta"):
                content = " ".join(f"{word}{i}" for i in range(40))
                pinned = gw.http.post(
                    "/v1/chat/completions",
                    json=chat(content, max_tokens=2),
                    headers={"x-data-parallel-rank": "1"},
                )
                assert pinned.status_code == 200
            wait_until(lambda: handle.stats(1).kv_next_sequence >= 3, 5, "batches published")
            # Every batch of the old publisher applied first: one applied late would pass for
            # a batch of the restarted publisher, before the subscriber has reconnected to it.
            wait_until(
                lambda: live_batches(gw, 1) >= handle.stats(1).kv_next_sequence,
                5,
                "published batches applied",
            )
            applied = live_batches(gw, 1)
            handle.faults.restart_kv_publisher(1)
            assert handle.stats(1).kv_next_sequence == 0
            # A restarted vLLM takes seconds to load before it publishes again; here the
            # subscriber is given the moment it needs to reconnect (batches sent before that
            # are invisible until a later one reveals the restart).
            filler = iter(range(1000))

            def relinked() -> bool:
                content = " ".join(f"eta{next(filler)}x{i}" for i in range(20))
                pinned = gw.http.post(
                    "/v1/chat/completions",
                    json=chat(content, max_tokens=1),
                    headers={"x-data-parallel-rank": "1"},
                )
                assert pinned.status_code == 200
                return live_batches(gw, 1) > applied

            wait_until(relinked, 10, "the subscriber hears the restarted publisher")
        # The first batch (the warm prefix) is the one lost; the next ones reveal the gap.
        for content in (f"{prefix} warm", f"{other} one", f"{other} two"):
            pinned = gw.http.post(
                "/v1/chat/completions",
                json=chat(content, max_tokens=2),
                headers={"x-data-parallel-rank": "1"},
            )
            assert pinned.status_code == 200
        stats = handle.stats(1)
        if fault == "drop":
            assert stats.kv_batches_dropped >= 1
        # The router learns of the lost batch (or the restart) only from the batches after it,
        # and applies them a few milliseconds later (the intake lets them gather). An unpinned
        # request sent before that lands on rank 0, which then caches the prefix too.
        wait_until(
            lambda: live_batches(gw, 1) >= handle.stats(1).kv_next_sequence,
            5,
            "rank 1's batches applied, the lost one included",
        )
        before = {rank: s.requests_received for rank, s in handle.all_stats().items()}

        def routed_to_cache() -> bool:
            response = gw.http.post(
                "/v1/chat/completions", json=chat(f"{prefix} warm", max_tokens=2)
            )
            assert response.status_code == 200
            return handle.stats(1).requests_received > before[1]

        wait_until(routed_to_cache, 10, "an unpinned request follows the cached prefix to rank 1")
        before = {rank: s.requests_received for rank, s in handle.all_stats().items()}
        for i in range(4):
            response = gw.http.post(
                "/v1/chat/completions", json=chat(f"{prefix} warm {i}", max_tokens=2)
            )
            assert response.status_code == 200
        after = {rank: s.requests_received for rank, s in handle.all_stats().items()}
        assert after[1] - before[1] == 4, (before, after)
        assert after[0] == before[0]
        assert_clean(handle, gw)


def live_batches(gw: Gateway, rank: int) -> float:
    """KV-event batches the gateway's router has applied for ``rank`` (from /metrics)."""
    total = 0.0
    for line in gw.http.get("/metrics").text.splitlines():
        if line.startswith("rankgate_kv_event_batches_total{") and f'rank="{rank}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_reply_that_does_not_parse_is_502_and_is_not_retried_elsewhere() -> None:
    """An engine breaking the contract is no busy rank: the client gets 502
    ``bad_engine_response`` at once, no other rank is asked, and nothing keeps running."""
    with mock_engine(speed=0.0, dp_size=4) as handle, gateway(handle, policy="load") as gw:
        handle.faults.garble_replies()
        retries = gw.sidecar().retries
        for streamed in (False, True):
            before = handle.all_stats()
            body = chat("parse me", max_tokens=6, stream=streamed)
            response = gw.http.post("/v1/chat/completions", json=body)
            assert response.status_code == 502, response.text
            assert response.json()["error"]["code"] == "bad_engine_response"
            after = handle.all_stats()
            received = sum(after[r].requests_received - before[r].requests_received for r in after)
            assert received == 1
        assert gw.sidecar().retries == retries
        handle.faults.garble_replies(0)
        assert_clean(handle, gw)
