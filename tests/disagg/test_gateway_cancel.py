"""Clients that hang up over HTTP at each phase of a disaggregated request leave both mock
engines with nothing stranded, nothing leaked and nothing running."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from rankgate.sidecar.admission import AdmissionConfig
from tests.disagg.conftest import Pair, chat_body, engine_pair, gateway_url
from tests.support.metrics import metric_total
from tests.support.polling import until

# A long prompt prefills for about 2 s; a decode waits 1 s for its KV, then steps every 50 ms.
SLOW = {
    "prefill": {"prefill_seconds_per_token": 10e-3},
    "decode": {"kv_transfer_seconds": 1.0, "decode_step_seconds": 0.05},
}


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with engine_pair(**SLOW) as engines:
        yield engines


@pytest.fixture(scope="module")
def url(pair: Pair) -> Iterator[str]:
    with gateway_url(pair) as base:
        yield base


async def hang_up_when(url: str, body: dict[str, Any], condition: Callable[[], bool]) -> list[str]:
    """Send ``body`` and drop the connection once ``condition()`` holds; the lines read."""
    lines: list[str] = []

    async def talk() -> None:
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                lines.append(line)  # noqa: PERF401 (read while the stream runs)

    task = asyncio.ensure_future(talk())
    await until(
        lambda: condition() or task.done(), 20, "the moment to hang up, or the end of the request"
    )
    assert not task.done(), "the request ended before the client could hang up"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return lines


def long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"word{i}" for i in range(120))


def ended(url: str) -> float:
    """The requests the gateway has ended, whatever their status (a hung-up stream's is the
    200 it had already sent)."""
    with httpx.Client(base_url=url) as http:
        return metric_total(http, "rankgate_http_requests_total")


def assert_clean(pair: Pair) -> None:
    for side in ("prefill", "decode"):
        totals = pair.totals(side)
        assert (totals.active, totals.leaked, totals.stranded_transfers) == (0, 0, 0), side


@pytest.mark.parametrize("stream", [False, True])
async def test_hang_up_during_prefill(pair: Pair, url: str, stream: bool) -> None:
    prefill_before, decode_before = pair.totals("prefill"), pair.totals("decode")
    body = chat_body(long_prompt(f"prefill-{stream}"), stream=stream, max_tokens=50)
    await hang_up_when(url, body, lambda: pair.totals("prefill").running > prefill_before.running)
    # Dropped at once, long before its two-second prefill could end; no decode was sent.
    await until(pair.idle, 1.5, "the pair idle")
    prefill = pair.totals("prefill")
    assert prefill.aborts == prefill_before.aborts + 1
    assert prefill.requests_served == prefill_before.requests_served
    assert pair.totals("decode").requests_received == decode_before.requests_received
    assert_clean(pair)


@pytest.mark.parametrize("stream", [False, True])
async def test_hang_up_after_decode_submission(pair: Pair, url: str, stream: bool) -> None:
    before = pair.totals("decode")
    body = chat_body(f"submitted-{stream}", stream=stream, max_tokens=50)
    left = ended(url)
    await hang_up_when(url, body, lambda: pair.totals("decode").transferring == 1)
    await until(lambda: ended(url) > left, 10, "the gateway ends the request")
    # The client is gone; the decode stays attached until its KV transfer is done.
    assert pair.totals("decode").transferring == 1
    await until(pair.idle, 20, "the pair idle")
    decode = pair.totals("decode")
    assert decode.transfers_completed == before.transfers_completed + 1
    assert decode.aborts == before.aborts + 1
    assert_clean(pair)


async def test_hang_up_after_the_first_token(pair: Pair, url: str) -> None:
    decode_before = pair.totals("decode")
    body = chat_body("first-token", stream=True, max_tokens=200)
    lines = await hang_up_when(
        url,
        body,
        lambda: pair.totals("decode").generated_tokens > decode_before.generated_tokens + 2,
    )
    assert any(line.startswith("data: ") for line in lines)
    await until(pair.idle, 5.0, "the pair idle")
    decode = pair.totals("decode")
    assert decode.aborts == decode_before.aborts + 1
    assert decode.generated_tokens - decode_before.generated_tokens < 100
    assert_clean(pair)


async def read_all(url: str, body: dict[str, Any]) -> None:
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        async for _ in response.aiter_lines():
            pass


LONG = {"max_tokens": 400}


async def test_hang_up_while_the_decode_waits_for_admission() -> None:
    """The prefill side holds the KV for a decode that no slot lets go: handed off at once
    (one token, outside admission), it is read and freed long before the KV lease ends."""
    with (
        engine_pair(**SLOW) as pair,
        gateway_url(pair, admission=AdmissionConfig(per_rank=1)) as url,
    ):
        blockers = [
            asyncio.ensure_future(
                read_all(url, chat_body(f"blocker-{i}", stream=True, max_tokens=400))
            )
            for i in range(2)
        ]
        await until(
            lambda: pair.totals("decode").running == 2,
            20,
            lambda: f"{pair.totals('decode').running} running on the decode engine",
        )
        before = pair.totals("prefill")
        assert before.held_transfers == 0
        body = chat_body("waits-for-a-slot", stream=True, max_tokens=5)
        await hang_up_when(url, body, lambda: pair.totals("prefill").held_transfers == 1)
        await until(
            lambda: pair.totals("prefill").transfers_released == before.transfers_released + 1,
            10.0,  # well inside the 30 s lease
            lambda: f"{pair.totals('prefill').transfers_released} transfers released",
        )
        prefill = pair.totals("prefill")
        assert (prefill.held_transfers, prefill.leases_expired) == (0, 0)
        # The blockers still run (the one-token hand-off may not have ended yet).
        assert pair.totals("decode").running >= 2
        for task in blockers:
            task.cancel()
        await asyncio.gather(*blockers, return_exceptions=True)
        await until(pair.idle, 20, "the pair idle")
        assert_clean(pair)
