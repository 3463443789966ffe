"""A hot prefix through ``rankgate serve`` against the mocker (DP=4, KV events, eight running
requests a rank): every conversation opens with the same long system prompt, eight clients
keep a request each in flight (as many as one rank can run), and the engine's own counters
say where the work went.

The kv policy opens a second copy of the prefix while the rank holding the first still has
slots free, and no rank takes more than 1.5 times its share of the requests. The control is
the cache-greedy rule (the share and decode terms off, as vllm-router's ``kv_aware`` weighs
neither): on the same traffic it fills one rank to its running limit, so the properties can
fail.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import pytest

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.mock_engine import RankStats, kv_mock_config, running_mock_engine

pytestmark = pytest.mark.timeout(120)

MODEL = "hot-prefix-llm"
DP = 4
MAX_RUNNING = 8
CLIENTS = 8
TURNS = 8
SHARE_BOUND = 1.5
SYSTEM = "You are the support desk of a large airline and answer travellers kindly. " * 24
CACHE_GREEDY = ("--route-share-weight", "0", "--route-decode-weight", "0")


@dataclass(frozen=True)
class Outcome:
    stats: list[RankStats]

    @property
    def requests(self) -> list[int]:
        return [s.requests_received for s in self.stats]

    @property
    def request_share(self) -> float:
        """The busiest rank's requests over a fair share of them."""
        return max(self.requests) * DP / sum(self.requests)

    @property
    def hit_rate(self) -> float:
        return sum(s.cached_tokens for s in self.stats) / sum(s.prompt_tokens for s in self.stats)


class Ramp:
    """Clients join one answer apart, as users arrive, rather than all in the same
    millisecond: a burst of first requests would all prefill the prefix at once wherever they
    went, whatever the router believed."""

    def __init__(self, clients: int) -> None:
        self._joined = [asyncio.Event() for _ in range(clients)]
        self._joined[0].set()
        self._answers = 0

    async def admitted(self, client: int) -> None:
        await self._joined[client].wait()

    def answered(self) -> None:
        self._answers += 1
        if self._answers < len(self._joined):
            self._joined[self._answers].set()


async def _client(http: httpx.AsyncClient, client: int, ramp: Ramp) -> None:
    await ramp.admitted(client)
    for turn in range(TURNS):
        response = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Traveller {client} asks question {turn}."},
                ],
                "max_tokens": 24,
                "min_tokens": 24,
                "temperature": 0,
            },
        )
        assert response.status_code == 200, (turn, response.text)
        ramp.answered()


def run(*flags: str) -> Outcome:
    config = kv_mock_config(MODEL, dp_size=DP, speed=1.0, max_running_requests=MAX_RUNNING)
    with running_mock_engine(config) as handle:
        argv = ["serve", "--engine", handle.target, "--tokenizer", str(TINY_TOKENIZER)]
        argv += ["--startup-timeout", "30", *flags]
        with serve_app(create_app(settings_from_args(build_parser().parse_args(argv)))) as url:

            async def drive() -> None:
                ramp = Ramp(CLIENTS)
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    await asyncio.gather(*(_client(http, c, ramp) for c in range(CLIENTS)))

            asyncio.run(drive())
            handle.wait_idle()
            outcome = Outcome([handle.stats(rank) for rank in handle.ranks])
    assert sum(outcome.requests) == CLIENTS * TURNS
    return outcome


def test_a_hot_prefix_spreads_before_its_rank_saturates() -> None:
    kv = run()
    greedy = run(*CACHE_GREEDY)
    print(
        f"\nkv: requests {kv.requests}, peak running {[s.peak_running for s in kv.stats]},"
        f" hit rate {kv.hit_rate:.3f}\ncache-greedy: requests {greedy.requests}, peak running"
        f" {[s.peak_running for s in greedy.stats]}, hit rate {greedy.hit_rate:.3f}"
    )
    # The cache-greedy rule piles the prefix's traffic onto one rank until it is full.
    assert max(s.peak_running for s in greedy.stats) == MAX_RUNNING
    assert greedy.request_share > SHARE_BOUND
    # The kv policy copied the prefix before any rank ran out of slots, and kept the share.
    assert max(s.peak_running for s in kv.stats) < MAX_RUNNING
    assert kv.request_share <= SHARE_BOUND
    # Each copy is one cold prefill of the system prompt (1.5 points of the hit rate here): the
    # hits stay near the greedy rule's.
    assert kv.hit_rate >= greedy.hit_rate - 0.08
