"""Clients that leave or stop reading: the engine request is aborted (mocker counters prove
it), quickly for a hang-up and after the stall timeout for a reader that stopped, while other
clients keep being served."""

from __future__ import annotations

import contextlib
import statistics
import time

import pytest

from rankgate.sidecar.admission import AdmissionConfig
from tests.chaos.harness import (
    assert_clean,
    chat,
    gateway,
    mock_engine,
    raw_stream_request,
    stream,
)
from tests.support.mock_engine import MockEngineHandle
from tests.support.polling import wait_until

pytestmark = pytest.mark.timeout(90)
HANGUPS = 40


def aborts(handle: MockEngineHandle) -> int:
    total: int = handle.call(
        lambda: sum(handle.engine(rank).counters.aborts for rank in handle.ranks)
    )
    return total


def read_events(sock: object, count: int) -> None:
    buffer = b""
    while buffer.count(b"data: ") < count:
        chunk = sock.recv(65536)  # type: ignore[attr-defined]
        assert chunk, "the gateway closed the stream early"
        buffer += chunk


def test_a_hang_up_mid_stream_aborts_the_engine_request_within_100ms() -> None:
    latencies: list[float] = []
    with mock_engine(speed=1.0) as handle, gateway(handle) as gw:
        for i in range(HANGUPS):
            before = aborts(handle)
            sock = raw_stream_request(gw.port, chat(f"leaving {i}", max_tokens=5000))
            read_events(sock, 3)
            left = time.perf_counter()
            sock.close()
            while aborts(handle) == before:
                assert time.perf_counter() - left < 5, "the engine request was never aborted"
            latencies.append(time.perf_counter() - left)
        assert_clean(handle, gw)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, round(0.99 * len(latencies)))]
    print(
        f"\ndisconnect-to-abort over {len(latencies)} hang-ups: "
        f"p50 {statistics.median(latencies) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
        f"max {latencies[-1] * 1e3:.1f} ms"
    )
    assert p99 < 0.100


def test_a_hang_up_before_the_first_token_and_while_queued_leaves_nothing_behind() -> None:
    tight = AdmissionConfig(per_rank=1, queue=8, timeout=20)
    with mock_engine(speed=1.0) as handle, gateway(handle, admission=tight) as gw:
        admission = gw.admission
        holders = [
            raw_stream_request(gw.port, chat(f"holder {i}", max_tokens=5000)) for i in range(2)
        ]
        for sock in holders:
            read_events(sock, 2)
        assert admission.in_use == 2
        received = sum(s.requests_received for s in handle.all_stats().values())
        queued = raw_stream_request(gw.port, chat("queued", max_tokens=5))
        wait_until(lambda: admission.waiting == 1, 5, "the third request waits for a slot")
        queued.close()
        wait_until(lambda: admission.waiting == 0, 1, "a queued request whose client left")
        for sock in holders:
            sock.close()
        wait_until(lambda: admission.in_use == 0, 2, "slots come back")
        assert sum(s.requests_received for s in handle.all_stats().values()) == received
        assert_clean(handle, gw)


def test_a_reader_that_stops_is_cut_and_does_not_slow_the_others() -> None:
    with (
        mock_engine(speed=0.0) as handle,
        gateway(handle, stream_stall_timeout=0.5) as gw,
    ):
        before = aborts(handle)
        flood = chat("flood", max_tokens=60000, logprobs=True, top_logprobs=20)
        stuck = raw_stream_request(gw.port, flood, rcvbuf=4096)
        read_events(stuck, 1)
        began = time.monotonic()
        served = 0
        while aborts(handle) == before:
            assert time.monotonic() - began < 20, "the stalled stream was never cut"
            t = time.monotonic()
            result = stream(gw.http, chat(f"bystander {served}", max_tokens=16))
            assert result.finish == "length"
            assert time.monotonic() - t < 2.0, "a stalled reader held up another client"
            served += 1
        assert served >= 1
        stuck.close()
        assert_clean(handle, gw)


def test_a_reader_that_stops_is_cut_before_the_buffers_fill() -> None:
    """A stream at a slow model's pace (a few kilobytes a second) whose client stops reading
    is cut once the stall timeout has passed since it stopped, while its receive buffer still
    has most of its room: the gateway's sends never blocked, so only the client's shrinking
    TCP window could have told. A client that reads on is not cut."""
    room = 1 << 20
    with (
        mock_engine(speed=0.2) as handle,
        gateway(handle, stream_stall_timeout=1.0) as gw,
    ):
        before = aborts(handle)
        steady = raw_stream_request(gw.port, chat("a steady reader", max_tokens=60))
        stuck = raw_stream_request(gw.port, chat("a reader that stops", max_tokens=20000), room)
        read_events(stuck, 2)
        steady.settimeout(60)
        received = b""
        while b"data: [DONE]" not in received:
            chunk = steady.recv(65536)
            assert chunk, "the steady reader's stream was cut"
            received += chunk
        wait_until(lambda: aborts(handle) > before, 30, "the stopped reader was cut")
        stuck.setblocking(False)
        held = 0
        with contextlib.suppress(BlockingIOError):
            while chunk := stuck.recv(1 << 20):
                held += len(chunk)
        # Its window (half its buffer) would have had to close for a send to block.
        assert held < room // 8, f"cut only after {held} bytes piled up unread"
        stuck.close()
        steady.close()
        assert_clean(handle, gw)
