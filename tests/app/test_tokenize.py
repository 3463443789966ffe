"""/tokenize and /detokenize against the mock engine: counts agree with what vLLM reports."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.app.test_openai_sdk import MESSAGES, MODEL
from tests.multimodal.pictures import data_uri, encode, noise

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def engine_prompt_tokens(http: httpx.Client, path: str, body: dict[str, Any]) -> int:
    response = http.post(path, json={"model": MODEL, "max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    count: int = response.json()["usage"]["prompt_tokens"]
    return count


def test_a_chat_counts_what_the_engine_counts(mock_http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS}
    reported = engine_prompt_tokens(mock_http, "/v1/chat/completions", body)
    result = mock_http.post("/tokenize", json={"model": MODEL, **body}).json()
    assert result["count"] == reported == len(result["tokens"])
    assert result["max_model_len"] == 512
    assert result["token_strs"] is None
    # Without the generation prompt the template's assistant header is left out.
    shorter = mock_http.post(
        "/tokenize", json={"messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": False}
    ).json()
    assert shorter["count"] < result["count"]
    assert result["tokens"][: shorter["count"]] == shorter["tokens"]


def test_a_prompt_counts_as_completions_do(mock_http: httpx.Client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    reported = engine_prompt_tokens(mock_http, "/v1/completions", {"prompt": prompt})
    result = mock_http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True})
    body = result.json()
    assert body["count"] == reported
    assert len(body["token_strs"]) == body["count"]
    plain = mock_http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})
    assert plain.json()["count"] <= body["count"]
    text = mock_http.post("/detokenize", json={"tokens": plain.json()["tokens"]}).json()
    assert text == {"prompt": prompt}


def test_an_image_counts_its_expanded_tokens(mock_http: httpx.Client) -> None:
    picture = data_uri(encode(noise(70, 50, seed=41), "PNG"))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": picture}},
            ],
        }
    ]
    # The engine says first how many tokens the picture becomes; then tokenize knows.
    reported = engine_prompt_tokens(mock_http, "/v1/chat/completions", {"messages": messages})
    result = mock_http.post("/tokenize", json={"messages": messages})
    assert result.status_code == 200, result.text
    assert result.json()["count"] == reported


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "messages": MESSAGES}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "chat_template": "{{ x }}"}, "chat_template"),
        ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
        ({"prompt": "x", "model": "nope"}, "model"),
    ],
)
def test_bad_tokenize_requests_name_the_field(
    mock_http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    response = mock_http.post("/tokenize", json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_detokenize_refuses_ids_outside_the_vocabulary(mock_http: httpx.Client) -> None:
    response = mock_http.post("/detokenize", json={"tokens": [1, 10**9]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tokens"


def _max_model_len(http: httpx.Client) -> int:
    response = http.post("/tokenize", json={"prompt": "hi"})
    assert response.status_code == 200, response.text
    value: int = response.json()["max_model_len"]
    return value


@pytest.mark.parametrize(
    ("path", "field"), [("/tokenize", "prompt"), ("/tokenize", "messages"), ("/detokenize", None)]
)
def test_more_tokens_than_the_context_holds_are_refused(
    mock_http: httpx.Client, path: str, field: str | None
) -> None:
    """The limits generation has: a prompt or token list past ``max_model_len`` is a 400."""
    limit = _max_model_len(mock_http)
    words = " ".join(f"w{i}" for i in range(limit + 8))
    bodies: dict[str | None, dict[str, Any]] = {
        "prompt": {"prompt": words},
        "messages": {"messages": [{"role": "user", "content": words}]},
        None: {"tokens": [5] * (limit + 1)},
    }
    body = bodies[field]
    response = mock_http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == (field or "tokens")


def test_a_text_too_long_to_fit_is_refused_without_tokenizing(mock_http: httpx.Client) -> None:
    text = "a" * 2_000_000
    response = mock_http.post("/tokenize", json={"prompt": text})
    assert response.status_code == 400
    assert "characters" in response.json()["error"]["message"]
