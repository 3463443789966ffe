"""``x-rankgate-route`` through HTTP against the mock engine (real sidecar, ``kv`` policy):
every answer says which rank served it and how much of its prompt the router believed cached,
and the rank it names is the rank the engine saw the request on."""

from __future__ import annotations

import os
import re

import httpx
import pytest

from tests.support.engines import EngineUnderTest

ROUTE = re.compile(
    r"rank=(?P<rank>\d+);cached=(?P<cached>\d+)/(?P<prompt>\d+);"
    r"policy=(?P<policy>\w+);reason=(?P<reason>\w+)(;choice=(?P<choice>\d+))?"
)


def route_of(response: httpx.Response) -> dict[str, str]:
    value = response.headers.get("x-rankgate-route")
    assert value is not None, dict(response.headers)
    found = ROUTE.fullmatch(value)
    assert found is not None, value
    return {k: v for k, v in found.groupdict().items() if v is not None}


def served_on(engine: EngineUnderTest, request_id: str) -> int:
    ranks = [
        rank
        for rank in range(engine.dp_size)
        if any(rid.startswith(request_id) for rid, _ in engine.mock.recent_prompts(rank))
    ]
    assert len(ranks) == 1, ranks
    return ranks[0]


def prompt(words: int = 80) -> str:
    return " ".join(f"w{os.urandom(2).hex()}" for _ in range(words))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_answers_name_the_rank_that_served_them(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest, stream: bool
) -> None:
    rid = f"route-chat-{os.urandom(4).hex()}"
    body = {
        "model": mock_vllm.served_model_name,
        "messages": [{"role": "user", "content": prompt()}],
        "max_tokens": 2,
        "temperature": 0,
        "request_id": rid,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    with mock_http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.read()
    assert response.status_code == 200, response.text
    route = route_of(response)
    assert route["policy"] == "kv"
    assert route["reason"] in ("best", "spill_hot", "spill_capacity")
    assert int(route["rank"]) == served_on(mock_vllm, rid)
    usage = (
        [line for line in response.text.splitlines() if '"usage":{' in line][-1]
        if stream
        else response.text
    )
    assert f'"prompt_tokens":{route["prompt"]}' in usage.replace(" ", "")


def test_a_repeated_completion_says_its_prefix_was_cached_on_the_same_rank(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    text = prompt(60)
    routes = []
    for turn in range(2):
        rid = f"route-again-{turn}-{os.urandom(4).hex()}"
        response = mock_http.post(
            "/v1/completions",
            json={
                "model": mock_vllm.served_model_name,
                "prompt": text,
                "max_tokens": 1,
                "temperature": 0,
                "request_id": rid,
            },
        )
        assert response.status_code == 200, response.text
        route = route_of(response)
        assert int(route["rank"]) == served_on(mock_vllm, rid)
        routes.append(route)
        mock_vllm.mock.wait_idle()
    first, second = routes
    assert first["cached"] == "0"
    assert second["rank"] == first["rank"]
    block = mock_vllm.block_size
    prompt_tokens = int(second["prompt"])
    assert int(second["cached"]) >= (prompt_tokens - 1) // block * block - block > 0


def test_a_fanned_out_request_names_the_choice_the_header_describes(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    response = mock_http.post(
        "/v1/completions",
        json={
            "model": mock_vllm.served_model_name,
            "prompt": [prompt(10), prompt(10)],
            "n": 2,
            "max_tokens": 1,
            "temperature": 0,
        },
    )
    assert response.status_code == 200, response.text
    route = route_of(response)
    assert 0 <= int(route.get("choice", "0")) < 4
    assert route["policy"] == "kv"
