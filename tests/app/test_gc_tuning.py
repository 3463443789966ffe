"""Start-up's objects are frozen out of the cyclic collector's passes once the app is up, and
a request leaves nothing for those passes to find."""

from __future__ import annotations

import gc

import httpx

from tests.support.cyclic_garbage import cyclic_garbage
from tests.support.engines import EngineUnderTest
from tests.support.metrics import metric_total
from tests.support.polling import wait_until


def test_startup_objects_are_frozen_once_the_gateway_is_up(scripted_http: httpx.Client) -> None:
    assert scripted_http.get("/ready").status_code == 200
    # The app, its routes and models, the tokenizer tables and the sidecar's state.
    assert gc.get_freeze_count() > 10_000


# What the gateway's request path is made of; the in-process mock engine and the test's own
# client are left out.
JSON = {"content-type": "application/json"}
GATEWAY_MODULES = ("rankgate.app", "rankgate.sidecar", "uvicorn", "starlette", "fastapi", "jinja2")


def test_a_served_request_leaves_nothing_for_the_cyclic_collector(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    model = mock_vllm.served_model_name

    def chat(i: int, stream: bool) -> httpx.Response:
        messages = [{"role": "user", "content": f"question {i}"}]
        body = {"model": model, "messages": messages, "max_tokens": 16, "stream": stream}
        return mock_http.post("/v1/chat/completions", json=body)

    assert chat(0, False).status_code == 200
    with cyclic_garbage(*GATEWAY_MODULES) as left:
        for i in range(1, 6):
            answer = chat(i, False)
            assert answer.json()["usage"]["completion_tokens"] == 16
            assert chat(i, True).text.rstrip().endswith("data: [DONE]")
            completion = {"model": model, "prompt": f"question {i}", "max_tokens": 3}
            assert mock_http.post("/v1/completions", json=completion).status_code == 200
            response = {"model": model, "input": f"question {i}", "max_output_tokens": 3}
            assert mock_http.post("/v1/responses", json=response).status_code == 200
            # An error answer is made from an exception, whose traceback holds frames.
            assert mock_http.post("/v1/chat/completions", json={"model": model}).status_code == 400
            broken = mock_http.post("/v1/chat/completions", content=b"{", headers=JSON)
            assert broken.status_code == 400
    assert not left


def test_a_failed_or_abandoned_request_leaves_nothing_for_the_cyclic_collector(
    mock_http: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    """Engine refusals and unreadable replies, streamed and not, and a stream its client
    leaves after the first token: each ends in an exception, whose traceback holds frames."""
    faults = mock_vllm.mock.faults
    model = mock_vllm.served_model_name

    def chat(i: int, stream: bool, max_tokens: int = 4) -> dict[str, object]:
        messages = [{"role": "user", "content": f"question {i}"}]
        return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}

    def in_flight() -> float:
        return metric_total(mock_http, "rankgate_http_requests_in_flight")

    assert mock_http.post("/v1/chat/completions", json=chat(0, False)).status_code == 200
    with cyclic_garbage(*GATEWAY_MODULES) as left:
        try:
            for i in range(1, 4):
                for stream in (False, True):
                    faults.reject_requests()
                    refused = mock_http.post("/v1/chat/completions", json=chat(i, stream))
                    assert refused.status_code == 429
                    faults.reject_requests(0)
                    faults.garble_replies(1)
                    garbled = mock_http.post("/v1/chat/completions", json=chat(i, stream))
                    assert garbled.status_code == 502
                faults.slow_steps(0.005)
                body = chat(i, True, max_tokens=100)
                with mock_http.stream("POST", "/v1/chat/completions", json=body) as answer:
                    assert answer.status_code == 200
                    assert next(answer.iter_lines()).startswith("data: ")
                faults.slow_steps(0)
                wait_until(
                    lambda: in_flight() == 0,
                    60,
                    lambda: f"{in_flight()} requests still in flight",
                )
        finally:
            faults.reject_requests(0)
            faults.garble_replies(0)
            faults.slow_steps(0)
    assert not left
