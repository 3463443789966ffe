"""Admission per DP rank through HTTP, against the mock engine (DP=2, one slot per rank): a
rank's slots are its own, unpinned requests fill every rank before any waits, a waiter runs on
the rank that frees, pinned waiters wait for their own rank only, and every path gives its
slot back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from rankgate.sidecar.admission import GROUP, AdmissionConfig
from tests.chaos.harness import (
    Gateway,
    assert_clean,
    chat,
    gateway,
    mock_engine,
    raw_stream_request,
    refuse_on_rank,
)
from tests.support.mock_engine import MockEngineHandle
from tests.support.polling import wait_until

pytestmark = pytest.mark.timeout(90)

ROUTE = "x-rankgate-route"
ONE_SLOT = AdmissionConfig(per_rank=1, queue=8, timeout=20)


class Holder:
    """A long stream that holds one slot (on ``rank`` when given) until it is closed; ``rank``
    is where the gateway says it routed it."""

    def __init__(self, gw: Gateway, name: str, rank: int | None = None, n: int = 1) -> None:
        body = chat(name, max_tokens=5000, n=n)
        if rank is not None:
            body["data_parallel_rank"] = rank
        self.sock = raw_stream_request(gw.port, body)
        buffer = b""
        while buffer.count(b"data: ") < 2:
            chunk = self.sock.recv(65536)
            assert chunk, "the gateway closed the stream early"
            buffer += chunk
        head = buffer.split(b"\r\n\r\n", 1)[0].decode().lower()
        route = next(line for line in head.split("\r\n") if line.startswith(ROUTE))
        self.rank = route_rank(route.split(":", 1)[1].strip())

    def close(self) -> None:
        self.sock.close()


def hold(gw: Gateway, name: str, rank: int | None = None) -> Holder:
    return Holder(gw, name, rank)


def route_rank(value: str) -> int | None:
    rank = dict(part.split("=", 1) for part in value.split(";"))["rank"]
    return None if rank == "none" else int(rank)


def used(gw: Gateway) -> dict[int, int]:
    return dict(gw.admission.used)


def streaming(handle: MockEngineHandle, prefix: str) -> bool:
    """Whether the engine has taken a request whose id starts with ``prefix``."""
    return any(
        rid.startswith(prefix) for rank in handle.ranks for rid, _ in handle.recent_prompts(rank)
    )


def routed_rank(response: httpx.Response) -> int | None:
    assert response.status_code == 200, response.text
    return route_rank(response.headers[ROUTE])


def test_pinned_requests_queue_for_their_rank_while_the_other_rank_serves_at_once() -> None:
    config = AdmissionConfig(per_rank=1, queue=4, timeout=1.5, retry_after=3)
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=config) as gw:
        holder = hold(gw, "hold rank 0", rank=0)
        assert used(gw) == {0: 1, 1: 0}
        with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=gw.url, timeout=30) as other:
            began = time.monotonic()
            queued = pool.submit(
                other.post,
                "/v1/chat/completions",
                json=chat("pinned 0", max_tokens=2, data_parallel_rank=0),
            )
            wait_until(lambda: gw.admission.waiting == 1, 5, "the rank-0 request waits")
            metrics = gw.http.get("/metrics").text
            assert 'rankgate_admission_waiting{rank="0"} 1.0' in metrics
            assert 'rankgate_admission_in_use{rank="0"} 1.0' in metrics
            assert 'rankgate_admission_in_use{rank="1"} 0.0' in metrics
            # Rank 1 has its slot free: pinned and unpinned requests go at once, several times.
            for body in (
                chat("pinned 1", max_tokens=2, data_parallel_rank=1),
                chat("free", max_tokens=2),
            ):
                quick = time.monotonic()
                response = gw.http.post("/v1/chat/completions", json=body)
                assert routed_rank(response) == 1
                assert time.monotonic() - quick < 1.0
            assert gw.admission.waiting == 1
            late = queued.result(10)
            assert late.status_code == 429
            assert late.json()["error"]["type"] == "rate_limit_error"
            assert late.json()["error"]["code"] == "gateway_overloaded"
            assert late.headers["retry-after"] == "3"
            refused = gw.http.get("/metrics").text
            assert 'rankgate_admission_refused_total{reason="timeout"} 1.0' in refused
            assert 1.3 < time.monotonic() - began < 5
        holder.close()
        wait_until(lambda: gw.admission.in_use == 0, 3, "every slot returned")
        assert_clean(handle, gw)


def test_unpinned_requests_fill_every_rank_before_any_waits_then_run_where_a_slot_frees() -> None:
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=ONE_SLOT) as gw:
        # The same prompt twice: KV affinity alone would send both to one rank.
        first = hold(gw, "the same conversation")
        second = hold(gw, "the same conversation")
        assert used(gw) == {0: 1, 1: 1}
        assert gw.admission.waiting == 0
        with ThreadPoolExecutor(1) as pool:
            waiter = pool.submit(
                gw.http.post, "/v1/chat/completions", json=chat("waiter", max_tokens=2)
            )
            wait_until(lambda: gw.admission.waiting == 1, 5, "the third request waits")
            assert {first.rank, second.rank} == {0, 1}
            second.close()
            # The freed rank is the only one with room: the waiter is routed there afresh.
            assert routed_rank(waiter.result(10)) == second.rank
        first.close()
        wait_until(lambda: gw.admission.in_use == 0, 3, "every slot returned")
        assert_clean(handle, gw)


def test_a_queued_pinned_request_that_hangs_up_leaves_nothing() -> None:
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=ONE_SLOT) as gw:
        holder = hold(gw, "hold", rank=1)
        received = sum(s.requests_received for s in handle.all_stats().values())
        body = chat("queued", max_tokens=5, data_parallel_rank=1)
        queued = raw_stream_request(gw.port, body)
        wait_until(lambda: gw.admission.waiting == 1, 5, "the pinned request waits")
        queued.close()
        wait_until(lambda: gw.admission.waiting == 0, 1, "it leaves the queue at once")
        assert sum(s.requests_received for s in handle.all_stats().values()) == received
        holder.close()
        wait_until(lambda: gw.admission.in_use == 0, 3, "every slot returned")
        assert_clean(handle, gw)


def test_each_choice_of_n_holds_a_slot_on_its_rank() -> None:
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=ONE_SLOT) as gw:
        both = Holder(gw, "two choices", n=2)
        assert used(gw) == {0: 1, 1: 1}
        # No slot is left anywhere: a third stream waits.
        with ThreadPoolExecutor(1) as pool:
            waiter = pool.submit(gw.http.post, "/v1/completions", json=completion("after"))
            wait_until(lambda: gw.admission.waiting == 1, 5, "the next request waits")
            both.close()
            assert waiter.result(10).status_code == 200
        wait_until(lambda: gw.admission.in_use == 0, 3, "every slot returned")
        assert_clean(handle, gw)


def completion(prompt: str) -> dict[str, object]:
    return {"model": chat()["model"], "prompt": prompt, "max_tokens": 2}


def test_the_engine_policy_admits_against_the_whole_group() -> None:
    with (
        mock_engine(speed=1.0) as handle,
        gateway(handle, admission=ONE_SLOT, policy="engine") as gw,
    ):
        assert gw.admission.limit == {GROUP: 2}
        holders = [hold(gw, f"hold {i}") for i in range(2)]
        with ThreadPoolExecutor(1) as pool:
            waiter = pool.submit(gw.http.post, "/v1/chat/completions", json=chat(max_tokens=2))
            wait_until(lambda: gw.admission.waiting == 1, 5, "a third request waits")
            holders[0].close()
            assert waiter.result(10).status_code == 200
        holders[1].close()
        wait_until(lambda: gw.admission.in_use == 0, 3, "every slot returned")
        assert_clean(handle, gw)


def test_slots_return_to_zero_after_a_burst_with_hang_ups_and_retries() -> None:
    config = AdmissionConfig(per_rank=2, queue=64, timeout=20)
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=config) as gw:
        engine = gw.sidecar()
        # A refusal retried: rank 1 busier, so rank 0 is chosen; it refuses, rank 1 has a slot.
        holder = hold(gw, "busy", rank=1)
        refuse_on_rank(handle, 0, 1)
        retried = gw.http.post("/v1/chat/completions", json=chat("retried", max_tokens=3))
        assert routed_rank(retried) == 1
        assert engine.retries == 1
        assert used(gw) == {0: 0, 1: 1}
        holder.close()
        # Then a burst where rank 0 refuses again: each refusal is retried on rank 1 when it
        # has a slot, or answered 429 when it has none.
        refuse_on_rank(handle, 0, 6)
        with ThreadPoolExecutor(8) as pool, httpx.Client(base_url=gw.url, timeout=30) as other:
            bodies = [chat(f"burst {i}", max_tokens=3, n=1 + i % 2) for i in range(16)]
            pending = [pool.submit(other.post, "/v1/chat/completions", json=b) for b in bodies]
            # Clients that leave: some while queued, some mid-stream, some before sending.
            hang_ups = [
                raw_stream_request(
                    gw.port, chat(f"leaving {i}", max_tokens=5000), request_id=f"leaving-{i}"
                )
                for i in range(6)
            ]
            # They leave once one of them streams from the engine, the rest queued or on
            # their way.
            wait_until(lambda: streaming(handle, "leaving-"), 20, "a hang-up reached the engine")
            for sock in hang_ups:
                sock.close()
            results = [future.result(30) for future in pending]
        statuses = {response.status_code for response in results}
        assert statuses <= {200, 429}, [r.text for r in results]
        assert 200 in statuses
        wait_until(lambda: gw.admission.in_use == 0, 5, "every slot returned")
        assert gw.admission.waiting == 0
        assert gw.admission.free == 4
        assert not gw.admission.full
        metrics = gw.http.get("/metrics").text
        assert 'rankgate_admission_in_use{rank="0"} 0.0' in metrics
        assert 'rankgate_admission_slots{rank="1"} 2.0' in metrics
        assert_clean(handle, gw)


# ---- fan-out (issue 18): capped per request, admitted whole -------------------------------


def batch(prompts: list[str], **fields: Any) -> dict[str, Any]:
    return {"model": chat()["model"], "prompt": prompts, "max_tokens": 4, **fields}


def received(handle: MockEngineHandle) -> int:
    return sum(stats.requests_received for stats in handle.all_stats().values())


def test_a_fan_out_past_the_cap_is_refused_before_anything_runs() -> None:
    with mock_engine(speed=0.0) as handle, gateway(handle, admission=ONE_SLOT) as gw:
        before = received(handle)
        started = time.monotonic()
        # 3 KB that would become 32,768 engine requests.
        body = batch([f"p{i}" for i in range(256)], n=128)
        response = gw.http.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "too_many_choices"
        assert error["param"] == "n"
        assert "32768" in error["message"]
        assert time.monotonic() - started < 5
        assert received(handle) == before
        assert_clean(handle, gw)


def test_a_batch_is_admitted_whole_or_refused_whole() -> None:
    """Four slots, three held: a two-prompt batch must not run its first prompt in the free
    slot and then be refused for the second; it waits for both, and is refused with 429
    having sent nothing when they do not free in time."""
    config = AdmissionConfig(per_rank=2, queue=4, timeout=1.0)
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=config) as gw:
        holders = [hold(gw, "hold 1"), hold(gw, "hold 2"), hold(gw, "hold 3")]
        try:
            assert sum(used(gw).values()) == 3
            before = received(handle)
            refused = gw.http.post("/v1/completions", json=batch(["one", "two"]))
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "gateway_overloaded"
            assert received(handle) == before
            assert sum(used(gw).values()) == 3
        finally:
            for holder in holders:
                holder.close()
        wait_until(lambda: sum(used(gw).values()) == 0, 10, "the holders' slots come back")
        whole = gw.http.post("/v1/completions", json=batch(["one", "two"], n=2))
        assert whole.status_code == 200, whole.text
        assert sorted(c["index"] for c in whole.json()["choices"]) == [0, 1, 2, 3]
        assert_clean(handle, gw)


def test_a_waiting_batch_takes_its_slots_together() -> None:
    config = AdmissionConfig(per_rank=2, queue=4, timeout=20)
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=config) as gw:
        holders = [hold(gw, "hold 1"), hold(gw, "hold 2"), hold(gw, "hold 3")]
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=gw.url, timeout=30) as other:
            before = received(handle)
            waiting = pool.submit(
                other.post, "/v1/completions", json=batch(["one", "two", "three"])
            )
            wait_until(lambda: gw.admission.waiting == 1, 10, "the batch waits for its slots")
            # One slot is free, but the batch needs three: nothing of it has run.
            assert sum(used(gw).values()) == 3
            assert not waiting.done()
            assert received(handle) == before
            for holder in holders:
                holder.close()
            response = waiting.result(30)
        assert response.status_code == 200, response.text
        assert sorted(c["index"] for c in response.json()["choices"]) == [0, 1, 2]
        assert_clean(handle, gw)
