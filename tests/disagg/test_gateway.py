"""The full disaggregated path over HTTP: a prefill and a decode mock engine (DP=2 each).

The decode role refuses any request whose ``kv_transfer_params`` a prefill engine did not issue
for that very prompt and its images, so every successful answer here proves the params were
forwarded verbatim with the original prompt and media. An aggregated engine of the same model
beside them is the reference: clients must not be able to tell the two topologies apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.disagg.conftest import MODEL, Pair, chat_body, engine_config, engine_pair, gateway_url
from tests.multimodal.pictures import data_uri, encode, noise
from tests.support.mock_engine import running_mock_engine


@pytest.fixture(scope="module", params=["combined", "split"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Both engines in vLLM 0.32's service layout, then in vLLM main's split one (KV-event
    discovery on vllm.KvTransfer, health per service)."""
    layout = {"grpc_services": request.param}
    with engine_pair(layout, layout) as engines:
        yield engines


@pytest.fixture(scope="module")
def split(pair: Pair) -> Iterator[httpx.Client]:
    with gateway_url(pair) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def aggregated() -> Iterator[httpx.Client]:
    """The same model served by one engine doing both phases."""
    with running_mock_engine(engine_config("both")) as engine:
        settings = GatewaySettings(engine=engine.target, tokenizer=str(TINY_TOKENIZER))
        app = create_app(settings, media=MediaPreparer(MediaConfig()))
        with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            yield client


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


def stream_chunks(
    client: httpx.Client, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> list[dict[str, Any]]:
    chunks = []
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = orjson.loads(line[6:])
                chunk.pop("id")
                chunk.pop("created")
                chunks.append(chunk)
    return chunks


def stream_summary(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client reads from a stream; how tokens are grouped into chunks depends on
    timing (an engine hands a slow reader everything produced since its last read at once)."""
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    shapes = set()
    for chunk in chunks:
        shapes.add((chunk["object"], chunk["model"], tuple(sorted(chunk))))
        for choice in chunk["choices"]:
            index = choice["index"]
            text[index] = text.get(index, "") + (choice["delta"].get("content") or "")
            if choice.get("finish_reason"):
                finish[index] = choice["finish_reason"]
    return {
        "text": text,
        "finish": finish,
        "shapes": shapes,
        "first": chunks[0],
        "usage": chunks[-1].get("usage"),
    }


def test_chat_runs_prefill_then_decode_and_answers_like_one_engine(
    pair: Pair, split: httpx.Client, aggregated: httpx.Client
) -> None:
    prefill_before, decode_before = pair.totals("prefill"), pair.totals("decode")
    body = chat_body("Tell me about prefill and decode.", max_tokens=12)
    response = split.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reference = aggregated.post("/v1/chat/completions", json=body)
    assert comparable(response.json()) == comparable(reference.json())
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 12
    prefill, decode = pair.totals("prefill"), pair.totals("decode")
    # One prefill of exactly one token, then one decode fed by a completed KV transfer.
    assert prefill.requests_served - prefill_before.requests_served == 1
    assert prefill.generated_tokens - prefill_before.generated_tokens == 1
    assert decode.requests_served - decode_before.requests_served == 1
    assert decode.transfers_completed - decode_before.transfers_completed == 1
    assert decode.prompt_tokens - decode_before.prompt_tokens == usage["prompt_tokens"]
    assert (prefill.stranded_transfers, decode.stranded_transfers) == (0, 0)
    assert (prefill.leaked, decode.leaked) == (0, 0)


def test_streaming_matches_the_aggregated_stream(
    split: httpx.Client, aggregated: httpx.Client
) -> None:
    body = chat_body(
        "Stream me a few tokens.",
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = stream_chunks(split, body)
    assert stream_summary(chunks) == stream_summary(stream_chunks(aggregated, body))
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_completions_with_n_and_a_seed_match_the_aggregated_choices(
    split: httpx.Client, aggregated: httpx.Client
) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "n": 3,
        "temperature": 1.0,
        "seed": 11,
    }
    response = split.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    assert len({c["text"] for c in choices}) > 1
    reference = aggregated.post("/v1/completions", json=body).json()
    assert comparable(response.json()) == comparable(reference)


@pytest.mark.parametrize("stream", [False, True])
def test_images_reach_both_engines_the_same_way(
    pair: Pair, split: httpx.Client, aggregated: httpx.Client, stream: bool
) -> None:
    picture = data_uri(encode(noise(90, 60, seed=7 + stream), "PNG"))
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": picture}},
    ]
    body = chat_body("", messages=[{"role": "user", "content": content}], max_tokens=5)
    decode_before = pair.totals("decode")
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        chunks = stream_chunks(split, body)
        assert stream_summary(chunks) == stream_summary(stream_chunks(aggregated, body))
        usage = chunks[-1]["usage"]
    else:
        response = split.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        reference = aggregated.post("/v1/chat/completions", json=body)
        assert comparable(response.json()) == comparable(reference.json())
        usage = response.json()["usage"]
    # 90x60 pixels in 28-pixel patches: 4 x 3 image tokens in place of one placeholder.
    text_only = split.post(
        "/v1/chat/completions",
        json=chat_body("", messages=[{"role": "user", "content": content[:1]}], max_tokens=1),
    ).json()["usage"]["prompt_tokens"]
    assert usage["prompt_tokens"] == text_only + 12
    decode = pair.totals("decode")
    assert decode.transfers_completed - decode_before.transfers_completed == 2
    assert decode.stranded_transfers == 0


def test_prefill_failure_reaches_the_client_and_no_decode_is_sent(
    pair: Pair, split: httpx.Client
) -> None:
    decode_before = pair.totals("decode")
    # Every rank refuses: a refusal by one rank alone is retried on another.
    pair.prefill.faults.reject_requests(-1, "prefill queue is full")
    try:
        response = split.post("/v1/chat/completions", json=chat_body("refused at prefill"))
    finally:
        pair.prefill.faults.reject_requests(0)
    assert response.status_code == 429
    assert response.json()["error"]["message"].endswith("prefill queue is full")
    assert pair.totals("decode").requests_received == decode_before.requests_received


def test_decode_failure_reaches_the_client(pair: Pair, split: httpx.Client) -> None:
    prefill_before = pair.totals("prefill")
    pair.decode.faults.reject_requests(-1, "decode queue is full")
    try:
        response = split.post("/v1/chat/completions", json=chat_body("refused at decode"))
    finally:
        pair.decode.faults.reject_requests(0)
    assert response.status_code == 429
    assert response.json()["error"]["message"].endswith("decode queue is full")
    assert pair.totals("prefill").requests_served == prefill_before.requests_served + 1
    assert pair.idle()


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_without_transfer_params_is_a_502_and_leaves_nothing_running(
    pair: Pair, split: httpx.Client, stream: bool
) -> None:
    decode_before = pair.totals("decode")
    pair.prefill.faults.withhold_transfer_params(1)
    response = split.post(
        "/v1/chat/completions", json=chat_body("no connector here", stream=stream)
    )
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "bad_engine_response"
    assert "without kv_transfer_params" in error["message"]
    assert pair.totals("decode").requests_received == decode_before.requests_received
    assert pair.idle()
    assert pair.totals("prefill").leaked == 0


def test_client_transfer_params_are_refused(pair: Pair, split: httpx.Client) -> None:
    prefill_before = pair.totals("prefill")
    body = chat_body("hand-made", kv_transfer_params={"do_remote_prefill": True})
    response = split.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "kv_transfer_params are set by the gateway" in error["message"]
    assert error["param"] == "kv_transfer_params"
    assert pair.totals("prefill").requests_received == prefill_before.requests_received


def test_a_pinned_rank_pins_the_decode(pair: Pair, split: httpx.Client) -> None:
    before = pair.decode.stats(1).requests_served
    response = split.post(
        "/v1/chat/completions",
        json=chat_body("pinned decode"),
        headers={"x-data-parallel-rank": "1"},
    )
    assert response.status_code == 200, response.text
    assert pair.decode.stats(1).requests_served == before + 1


def test_ready_and_models(split: httpx.Client) -> None:
    assert split.get("/ready").status_code == 200
    models = split.get("/v1/models").json()
    assert next(m["id"] for m in models["data"]) == MODEL


def test_prompt_logprobs_are_prefilled_where_they_decode(
    pair: Pair, split: httpx.Client, aggregated: httpx.Client
) -> None:
    """A transfer carries KV, not logprobs: the decode engine prefills such a request itself
    and answers as one engine would."""
    prefill_before, decode_before = pair.totals("prefill"), pair.totals("decode")
    body = {
        "model": MODEL,
        "prompt": "Score every token of this prompt.",
        "echo": True,
        "logprobs": 1,
        "max_tokens": 0,
        "temperature": 0.0,
    }
    response = split.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    reference = aggregated.post("/v1/completions", json=body)
    assert comparable(response.json()) == comparable(reference.json())
    choice = response.json()["choices"][0]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert len(choice["prompt_logprobs"]) == response.json()["usage"]["prompt_tokens"]
    prefill, decode = pair.totals("prefill"), pair.totals("decode")
    assert prefill.requests_received == prefill_before.requests_received
    assert decode.requests_served - decode_before.requests_served == 1
    assert decode.transfers_completed == decode_before.transfers_completed
