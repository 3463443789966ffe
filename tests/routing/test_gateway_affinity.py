"""Affinity keys through the HTTP surface: ``prompt_cache_key`` (chat and completions), the
operator's ``--affinity-header``, and Responses chains (``previous_response_id``).

The mock publishes no KV events and predictions from past routes expire at once, so the only
thing that can tell the router where a conversation's earlier turns went is its key; the route
header (``cached=``) shows what the router believed, and ``/metrics`` counts each key followed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.server import create_app
from rankgate.mocker.config import MockEngineConfig
from tests.app.serving import serve_app
from tests.app.test_route_header import route_of
from tests.conftest import TINY_TOKENIZER
from tests.support.mock_engine import running_mock_engine
from tests.support.ports import free_port

MODEL = "affinity-llm"
HISTORY = "You are a careful assistant who answers in one short sentence. " * 12


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=2,
        block_size=16,
        model=MODEL,
        tokenizer=str(TINY_TOKENIZER),
        model_id=str(TINY_TOKENIZER),
        speed=0.0,
    )
    with running_mock_engine(config) as handle:
        argv = [
            "serve", "--engine", handle.target, "--tokenizer", str(TINY_TOKENIZER),
            "--startup-timeout", "30", "--route-predict-ttl", "0.000001",
            "--affinity-header", "X-Session-Id",
        ]  # fmt: skip
        settings = settings_from_args(build_parser().parse_args(argv))
        with serve_app(create_app(settings)) as url, httpx.Client(base_url=url, timeout=60) as c:
            yield c


def _followed(http: httpx.Client) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            name, outcome = sample.name, sample.labels.get("outcome")
            if name == "rankgate_routing_affinity_total" and outcome == "followed":
                return sample.value
    return 0.0


def _chat(
    http: httpx.Client, turn: int, headers: dict[str, str] | None = None, **extra: Any
) -> dict[str, str]:
    messages = [{"role": "system", "content": HISTORY}]
    for earlier in range(turn):
        messages += [
            {"role": "user", "content": f"Question {earlier}?"},
            {"role": "assistant", "content": "An answer."},
        ]
    messages.append({"role": "user", "content": f"Question {turn}?"})
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, **extra}
    response = http.post("/v1/chat/completions", json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    return route_of(response)


@pytest.mark.parametrize(
    ("via", "extra", "headers"),
    [
        ("prompt_cache_key", {"prompt_cache_key": "conv-a"}, None),
        ("header", {}, {"x-session-id": "conv-b"}),
    ],
)
def test_a_named_chat_conversation_is_believed_cached_where_it_went(
    http: httpx.Client, via: str, extra: dict[str, Any], headers: dict[str, str] | None
) -> None:
    before = _followed(http)
    first = _chat(http, 0, headers, **extra)
    routes = [_chat(http, turn, headers, **extra) for turn in (1, 2)]
    assert {route["rank"] for route in routes} == {first["rank"]}
    # Each turn is believed to hold the previous turn's prompt, in whole blocks.
    assert all(int(route["cached"]) >= 128 for route in routes), (via, routes)
    assert _followed(http) == before + 2
    # The same conversation unnamed: nothing tells the router where it went.
    assert int(_chat(http, 3)["cached"]) == 0


def test_a_completion_names_its_conversation_with_prompt_cache_key(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": HISTORY, "max_tokens": 1, "prompt_cache_key": "doc-1"}
    first = route_of(http.post("/v1/completions", json=body))
    body["prompt"] = HISTORY + " And one more line."
    again = route_of(http.post("/v1/completions", json=body))
    assert again["rank"] == first["rank"]
    assert int(again["cached"]) >= 128


def test_a_responses_chain_is_one_conversation(http: httpx.Client) -> None:
    before = _followed(http)
    body: dict[str, Any] = {"model": MODEL, "input": HISTORY, "max_output_tokens": 1}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    first = route_of(response)
    previous = response.json()["id"]
    ranks = []
    for turn in range(2):
        body = {
            "model": MODEL,
            "input": f"Question {turn}?",
            "previous_response_id": previous,
            "max_output_tokens": 1,
        }
        response = http.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        route = route_of(response)
        assert int(route["cached"]) >= 128
        ranks.append(route["rank"])
        previous = response.json()["id"]
    assert ranks == [first["rank"]] * 2
    assert _followed(http) == before + 2
