"""The per-request prefill choice, through the gateway: short prompts and prompts the decode
engine already holds skip the transfer, long cold ones are prefilled remotely, an operator
can pin either, and ``/metrics`` counts each with its reason."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rankgate.sidecar import DisaggConfig
from tests.disagg.conftest import Pair, chat_body, engine_pair, gateway_url
from tests.support.metrics import metric_total
from tests.support.polling import wait_until

PREFILLS = "rankgate_pd_prefills_total"
INDEXED = "rankgate_routing_index_blocks"


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with engine_pair() as engines:
        yield engines


def client_for(pair: Pair, **config: Any) -> Any:
    return gateway_url(pair, disagg=DisaggConfig(**config))


def long_text(seed: int, words: int = 100) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(words))


def ask(client: httpx.Client, text: str) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json=chat_body(text, max_tokens=6))
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def served(pair: Pair) -> tuple[int, int]:
    return pair.totals("prefill").requests_received, pair.totals("decode").requests_received


def test_short_prompts_skip_the_transfer_and_long_cold_ones_take_it(pair: Pair) -> None:
    with client_for(pair) as url, httpx.Client(base_url=url, timeout=30) as client:
        before = served(pair)
        short = ask(client, "Say hello.")
        assert short["usage"]["prompt_tokens"] < 256
        assert served(pair) == (before[0], before[1] + 1)
        assert metric_total(client, PREFILLS, where="local", reason="short") == 1

        text = long_text(1)
        cold = ask(client, text)
        assert cold["usage"]["prompt_tokens"] > 256
        assert served(pair) == (before[0] + 1, before[1] + 2)
        assert metric_total(client, PREFILLS, where="remote", reason="cheaper") == 1

        # The decode engine now holds the prompt (it pulled its KV); once its KV events say
        # so, the same prompt is prefilled there: only the last block or so is left to do.
        wait_until(
            lambda: (
                metric_total(client, INDEXED, medium="device")
                >= cold["usage"]["prompt_tokens"] // 16
            ),
            10,
            lambda: f"{metric_total(client, INDEXED, medium='device')} blocks indexed",
        )
        again = ask(client, text)
        assert again["choices"][0]["message"] == cold["choices"][0]["message"]
        assert served(pair) == (before[0] + 1, before[1] + 3)
        assert metric_total(client, PREFILLS, where="local", reason="decode_cached") == 1


@pytest.mark.parametrize(("mode", "where"), [("remote", "remote"), ("local", "local")])
def test_an_operator_pins_either_placement(pair: Pair, mode: str, where: str) -> None:
    with (
        client_for(pair, prefill_mode=mode) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        before = served(pair)
        ask(client, "Say hello.")
        ask(client, long_text(2 if mode == "remote" else 3))
        prefilled_remotely = 2 if mode == "remote" else 0
        assert served(pair) == (before[0] + prefilled_remotely, before[1] + 2)
        assert metric_total(client, PREFILLS, where=where, reason="pinned") == 2
        assert metric_total(client, PREFILLS) == 2


def test_a_busy_prefill_engine_sends_long_prompts_to_the_decode_engine() -> None:
    """The prefill side's queue outweighs a local prefill: the prompt stays local."""
    with (
        engine_pair(prefill={"prefill_seconds_per_token": 4e-3}) as pair,
        client_for(pair, local_prefill_weight=1.5) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            # Two long prompts occupy the prefill engine (about 2 s each) ...
            busy = [pool.submit(ask, client, long_text(10 + i)) for i in range(2)]
            wait_until(
                lambda: pair.totals("prefill").running + pair.totals("prefill").waiting == 2,
                10,
                lambda: f"prefill: {pair.totals('prefill')}",
            )
            # ... so a third, as long and as cold, is cheaper on the decode engine.
            ask(client, long_text(20))
            for future in busy:
                future.result()
        assert metric_total(client, PREFILLS, where="remote", reason="cheaper") == 2
        assert metric_total(client, PREFILLS, where="local", reason="prefill_busy") == 1
