"""Pinning a DP rank through HTTP: the ``x-data-parallel-rank`` header (as with vLLM) or the
``data_parallel_rank`` body field; the engine must see the request on that rank, and a bad pin
is a 400 that names the rank (and the field, when it is about the field)."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from tests.app.test_route_header import route_of, served_on
from tests.support.engines import EngineUnderTest


def chat(
    http: httpx.Client,
    engine: EngineUnderTest,
    rid: str,
    headers: dict[str, Any] | None = None,
    **fields: Any,
) -> httpx.Response:
    body = {
        "model": engine.served_model_name,
        "messages": [{"role": "user", "content": f"pin me {rid}"}],
        "max_tokens": 1,
        "temperature": 0,
        "request_id": rid,
        **fields,
    }
    return http.post("/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize("how", ["header", "body"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_pinned_rank_serves_the_request(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest, how: str, rank: int
) -> None:
    rid = f"pin-{how}-{rank}-{os.urandom(4).hex()}"
    if how == "header":
        response = chat(mock_http, mock_vllm, rid, {"x-data-parallel-rank": str(rank)})
    else:
        response = chat(mock_http, mock_vllm, rid, data_parallel_rank=rank)
    assert response.status_code == 200, response.text
    assert served_on(mock_vllm, rid) == rank
    route = route_of(response)
    assert (route["rank"], route["reason"]) == (str(rank), "pinned")


def test_header_and_body_may_both_pin_the_same_rank(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    rid = f"pin-both-{os.urandom(4).hex()}"
    response = chat(mock_http, mock_vllm, rid, {"x-data-parallel-rank": "1"}, data_parallel_rank=1)
    assert response.status_code == 200, response.text
    assert served_on(mock_vllm, rid) == 1


@pytest.mark.parametrize(
    ("headers", "fields", "param", "message"),
    [
        (
            {"x-data-parallel-rank": "7"},
            {},
            None,
            "data-parallel rank 7 is not served here; served ranks: [0, 1]",
        ),
        (
            {},
            {"data_parallel_rank": 7},
            None,
            "data-parallel rank 7 is not served here; served ranks: [0, 1]",
        ),
        (
            {"x-data-parallel-rank": "0"},
            {"data_parallel_rank": 1},
            "data_parallel_rank",
            "'data_parallel_rank' is 1 but header 'x-data-parallel-rank' is 0; give one rank",
        ),
        (
            {"x-data-parallel-rank": "one"},
            {},
            "x-data-parallel-rank",
            "header 'x-data-parallel-rank' must be a non-negative decimal integer, got 'one'",
        ),
        # Digits that str.isdigit() accepts: int() refuses the first, reads the others.
        *(
            ({"x-data-parallel-rank": raw}, {}, "x-data-parallel-rank", None)
            for raw in (b"\xb2", "\u0663".encode(), b"\xef\xbc\x91", b"+1", b"-0", b"1.0")
        ),
        ({"x-data-parallel-rank": "9" * 40}, {}, "x-data-parallel-rank", None),
        ({}, {"data_parallel_rank": -1}, "data_parallel_rank", None),
        ({}, {"data_parallel_rank": "1"}, "data_parallel_rank", None),
    ],
)
def test_a_bad_pin_is_a_400_naming_it_and_reaches_no_rank(
    mock_http: httpx.Client,
    mock_vllm: EngineUnderTest,
    headers: dict[str, Any],
    fields: dict[str, Any],
    param: str | None,
    message: str | None,
) -> None:
    rid = f"pin-bad-{os.urandom(4).hex()}"
    for path in ("/v1/chat/completions", "/v1/completions"):
        if path == "/v1/chat/completions":
            response = chat(mock_http, mock_vllm, rid, headers, **fields)
        else:
            body = {"model": mock_vllm.served_model_name, "prompt": "x", "max_tokens": 1}
            response = mock_http.post(path, json={**body, **fields}, headers=headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"
        if message is not None:
            assert error["message"] == message
        else:
            assert param is not None
            assert param.replace("-", "_").removeprefix("x_") in error["message"].replace("-", "_")
    for rank in range(mock_vllm.dp_size):
        assert not any(r.startswith(rid) for r, _ in mock_vllm.mock.recent_prompts(rank))
