"""``/v1/completions`` prompt shapes through HTTP: a flat token array is one prompt of any
length; only a batch is limited in how many prompts it holds."""

from __future__ import annotations

import httpx
import pytest

from rankgate.app.prepare.completion import MAX_PROMPTS
from tests.support.engines import EngineUnderTest


def _complete(http: httpx.Client, prompt: object, model: str) -> httpx.Response:
    return http.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
    )


def test_a_flat_token_array_longer_than_the_batch_limit_is_one_prompt(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    tokens = [100 + i % 2000 for i in range(MAX_PROMPTS + 44)]
    response = _complete(mock_http, tokens, mock_vllm.served_model_name)
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == 1
    assert body["usage"]["prompt_tokens"] == len(tokens)


def test_a_batch_of_more_prompts_than_the_limit_is_refused_naming_the_limit(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    batch = [[100 + i] for i in range(MAX_PROMPTS + 1)]
    response = _complete(mock_http, batch, mock_vllm.served_model_name)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"] == f"'prompt' may hold at most {MAX_PROMPTS} prompts"
    texts = ["hello"] * (MAX_PROMPTS + 1)
    assert _complete(mock_http, texts, mock_vllm.served_model_name).status_code == 400


def test_a_batch_at_the_limit_is_served(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    batch = [[100 + i, 7] for i in range(MAX_PROMPTS)]
    response = _complete(mock_http, batch, mock_vllm.served_model_name)
    assert response.status_code == 200, response.text
    body = response.json()
    assert sorted(choice["index"] for choice in body["choices"]) == list(range(MAX_PROMPTS))
    assert body["usage"]["prompt_tokens"] == 2 * MAX_PROMPTS


@pytest.mark.parametrize(
    ("prompt", "param", "message"),
    [
        ([5, 6, -1], "prompt[2]", "token ids must be non-negative integers"),
        ([5, True, 6], "prompt[1]", "token ids must be non-negative integers"),
        ([5, 6.0], "prompt[1]", "token ids must be non-negative integers"),
        ([[5], [6, "7"]], "prompt[1][1]", "token ids must be non-negative integers"),
        ([5, 10**9], "prompt", "token id 1000000000 in 'prompt' is out of vocabulary"),
    ],
)
def test_a_bad_id_in_a_token_prompt_is_named(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest, prompt: object, param: str, message: str
) -> None:
    response = _complete(mock_http, prompt, mock_vllm.served_model_name)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(message)
