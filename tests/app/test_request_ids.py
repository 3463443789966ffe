"""Client-chosen request ids are echoed back as given but never collide inside the engine."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support.engines import EngineUnderTest


def test_concurrent_requests_with_one_client_id_stay_apart(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    shared = f"dup-{os.urandom(4).hex()}"
    body = {
        "model": mock_vllm.served_model_name,
        "messages": [{"role": "user", "content": "same id, different requests"}],
        "max_tokens": 4,
        "stream": True,
    }

    def send(_: int) -> httpx.Response:
        with mock_http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-request-id": shared}
        ) as response:
            response.read()
        return response

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(send, range(4)))
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == shared
        assert response.text.count("data: [DONE]") == 1
        assert '"finish_reason":"length"' in response.text
    seen = [
        rid
        for rank in range(mock_vllm.dp_size)
        for rid, _ in mock_vllm.mock.recent_prompts(rank)
        if rid.startswith(shared)
    ]
    assert len(seen) == 4
    assert len(set(seen)) == 4, seen
