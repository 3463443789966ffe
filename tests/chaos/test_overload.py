"""More load than the engine can take: slots from discovered capacity, a bounded priority
queue with a deadline, and 429 + Retry-After beyond it, all through HTTP."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rankgate.sidecar.admission import AdmissionConfig
from tests.chaos.harness import (
    assert_clean,
    chat,
    gateway,
    mock_engine,
    raw_stream_request,
)
from tests.chaos.test_clients import read_events
from tests.support.polling import wait_until

pytestmark = pytest.mark.timeout(90)


def test_limit_comes_from_discovered_capacity() -> None:
    with mock_engine(speed=0.0, max_running_requests=3) as handle, gateway(handle) as gw:
        assert gw.http.post("/v1/chat/completions", json=chat(max_tokens=1)).is_success
        # Each of the DP=2 ranks: 2 x max_running_requests 3.
        assert gw.admission.limit == {0: 6, 1: 6}
        assert_clean(handle, gw)


def test_queue_full_and_deadline_are_429_with_retry_after() -> None:
    config = AdmissionConfig(per_rank=1, queue=2, timeout=1.5)
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=config) as gw:
        admission = gw.admission
        holders = [raw_stream_request(gw.port, chat(f"hold {i}", max_tokens=5000)) for i in (0, 1)]
        for sock in holders:
            read_events(sock, 2)
        with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=gw.url, timeout=30) as other:
            low = pool.submit(
                other.post, "/v1/chat/completions", json=chat("low", max_tokens=2, priority=5)
            )
            wait_until(lambda: admission.waiting == 1, 5, "low waits")
            high = pool.submit(
                gw.http.post, "/v1/chat/completions", json=chat("high", max_tokens=2, priority=-5)
            )
            wait_until(lambda: admission.waiting == 2, 5, "high waits")
            full = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(max_tokens=2))
            assert full.status_code == 429
            assert full.json()["error"]["code"] == "gateway_overloaded"
            assert int(full.headers["retry-after"]) >= 1
            holders[0].close()
            assert high.result(10).status_code == 200
            assert low.result(10).status_code == 200
        # Deadline: keep the one remaining slot and a queued request past the timeout.
        blocker = raw_stream_request(gw.port, chat("block", max_tokens=5000))
        read_events(blocker, 2)
        began = time.monotonic()
        late = gw.http.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert late.status_code == 429
        assert "retry-after" in late.headers
        assert 1.3 < time.monotonic() - began < 5
        assert admission.waiting == 0
        for sock in (holders[1], blocker):
            sock.close()
        wait_until(lambda: admission.in_use == 0, 3, "every slot returned")
        assert_clean(handle, gw)


def test_priority_order_is_what_the_engine_sees() -> None:
    config = AdmissionConfig(per_rank=1, queue=8, timeout=20)
    with mock_engine(speed=1.0, dp_size=1) as handle, gateway(handle, admission=config) as gw:
        admission = gw.admission
        holder = raw_stream_request(gw.port, chat("hold", max_tokens=5000))
        read_events(holder, 2)
        with ThreadPoolExecutor(4) as pool:
            futures = []
            for name, priority in (("p-late", 9), ("p-mid", 3), ("p-first", -2)):
                client = httpx.Client(base_url=gw.url, timeout=30)
                futures.append(
                    pool.submit(
                        client.post,
                        "/v1/chat/completions",
                        json=chat(name, max_tokens=2, priority=priority),
                    )
                )
                expected: int = len(futures)

                def queued(n: int = expected) -> bool:
                    return bool(admission.waiting == n)

                wait_until(queued, 5, f"{name} queued")
            holder.close()
            assert all(f.result(20).status_code == 200 for f in futures)
        prompts = handle.recent_prompts(0)
        tokenizer = gw.serving().tokenizer
        seen = [
            name
            for _, ids in prompts
            for name in ("p-first", "p-mid", "p-late")
            if name in tokenizer.decode(ids)
        ]
        assert seen == ["p-first", "p-mid", "p-late"]
        assert_clean(handle, gw)
