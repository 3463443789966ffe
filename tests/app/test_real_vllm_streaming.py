"""Concurrent streams through the gateway on real vLLM arrive as streams, not in one burst.

With vLLM sharing the gateway's cores, its spinning CPU workers stall the gateway for
seconds, and a stream's first chunk arrives together with its last one: the client waits for
the whole answer, whatever the routing. Under the fair placement (``tests/support/placement.py``:
vLLM on one CPU, the gateway and this client on another) each stream must deliver its first
content chunk well before its halfway token. That is checked as a property of the chunks'
arrival order and spacing, not against a wall-clock threshold, so a slow machine passes and a
stalled stream does not. ``RANKGATE_REAL_VLLM_PLACEMENT=shared`` runs the same test on an
unpinned engine, where it fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.support.engines import EngineUnderTest
from tests.support.placement import on_gateway_cpus, placement_for_tests

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

STREAMS = 8
TOKENS = 48
ROUNDS = 3


@dataclass(frozen=True)
class Arrivals:
    """When each content chunk of one stream arrived, with the tokens generated so far."""

    chunks: tuple[tuple[float, int], ...]

    def first(self) -> float:
        return self.chunks[0][0]

    def at_token(self, count: int) -> float:
        return next(when for when, tokens in self.chunks if tokens >= count)

    def streamed(self) -> bool:
        """The first chunk came in the first half of the wait for the halfway token.

        A stalled stream delivers its chunks in one burst: the first one then comes just
        before the halfway token, not long before it.
        """
        return self.first() <= self.at_token(TOKENS // 2) / 2


@pytest.fixture(scope="module")
def placed_gateway(real_vllm: EngineUnderTest) -> Iterator[str]:
    """A gateway whose threads all run on the gateway CPUs (they inherit the starter's mask)."""
    settings = GatewaySettings(
        engine=real_vllm.target,
        tokenizer=str(real_vllm.tokenizer_dir),
        policy="round_robin",
        # A busy 2-core machine can take over the 1 s default to answer a health check.
        health_interval=5.0,
    )
    with (
        on_gateway_cpus(placement_for_tests()),
        serve_app(create_app(settings), timeout=300) as url,
    ):
        yield url


async def _stream(http: httpx.AsyncClient, model: str, index: int) -> Arrivals:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Stream {index}: tell a long story."}],
        "max_tokens": TOKENS,
        "min_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks: list[tuple[float, int]] = []
    started = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if not any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                continue
            chunks.append((time.perf_counter() - started, event["usage"]["completion_tokens"]))
    assert chunks
    assert chunks[-1][1] == TOKENS, chunks[-3:]
    return Arrivals(tuple(chunks))


async def _round(url: str, model: str) -> list[Arrivals]:
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as http:
        return list(await asyncio.gather(*(_stream(http, model, i) for i in range(STREAMS))))


def test_concurrent_streams_start_before_their_middle(
    real_vllm: EngineUnderTest, placed_gateway: str
) -> None:
    """At most one of N concurrent streams may miss, in each of a few rounds (the first round
    also warms vLLM's CPU kernels up for these shapes, and is held to the same bar)."""
    report: list[str] = []
    failing_rounds = 0
    with on_gateway_cpus(placement_for_tests()):
        for round_ in range(ROUNDS):
            arrivals = asyncio.run(_round(placed_gateway, real_vllm.served_model_name))
            missed = [a for a in arrivals if not a.streamed()]
            report.append(
                f"round {round_}: {len(missed)}/{STREAMS} bursts; first chunk / halfway token "
                "/ last (ms): "
                + ", ".join(
                    f"{a.first() * 1e3:.0f}/{a.at_token(TOKENS // 2) * 1e3:.0f}/"
                    f"{a.chunks[-1][0] * 1e3:.0f}"
                    for a in arrivals
                )
            )
            failing_rounds += len(missed) > 1
    print("\n".join(report))
    assert failing_rounds == 0, "\n".join(report)
