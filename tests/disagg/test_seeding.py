"""First-token seeding through the gateway: a streaming client's first token is the remote
prefill's, sent before the decode starts, and the whole stream is what one engine doing both
phases sends (greedy and seeded sampling, ``n``, logprobs, a stop string the first token
completes, ``max_tokens`` 1)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from rankgate.sidecar import DisaggConfig
from tests.disagg.conftest import MODEL, Pair, engine_pair, gateway_url
from tests.disagg.test_gateway import aggregated, stream_chunks, stream_summary
from tests.support.metrics import metric_total
from tests.support.polling import wait_until

__all__ = ["aggregated"]

SEEDED = "rankgate_pd_first_token_seeded_total"
# Long enough that the decode cannot have produced anything when the first chunk is read.
SLOW_PULL_S = 10.0


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with engine_pair() as engines:
        yield engines


@pytest.fixture(scope="module")
def split(pair: Pair) -> Iterator[httpx.Client]:
    config = DisaggConfig(prefill_mode="remote")
    with gateway_url(pair, disagg=config) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


def completion(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": "The prefill samples the first token and the decode the rest",
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(fields)
    return body


def completion_chunks(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    return stream_chunks(client, body, "/v1/completions")


def choices(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice: its text, token logprobs and top candidates, and finish reason."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            seen = out.setdefault(
                choice["index"], {"text": "", "tokens": [], "top": [], "finish": None}
            )
            seen["text"] += choice["text"]
            logprobs = choice.get("logprobs") or {}
            seen["tokens"] += logprobs.get("token_logprobs") or []
            seen["top"] += logprobs.get("top_logprobs") or []
            if choice.get("finish_reason"):
                seen["finish"] = choice["finish_reason"]
    return out


def usage(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = chunks[-1]["usage"]
    return found


def test_the_first_token_arrives_before_the_decode_has_produced_anything() -> None:
    config = DisaggConfig(prefill_mode="remote")
    with (
        engine_pair(decode={"kv_transfer_seconds": SLOW_PULL_S}) as pair,
        gateway_url(pair, disagg=config) as url,
        httpx.Client(base_url=url, timeout=60) as split,
        split.stream("POST", "/v1/completions", json=completion()) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert orjson.loads(first[6:])["choices"][0]["text"]
        # The decode pulls the prompt's KV for seconds: every token so far is the prefill's.
        assert pair.totals("decode").generated_tokens == 0
        for _ in lines:
            pass
        assert pair.totals("decode").generated_tokens == 10
        assert metric_total(split, SEEDED, outcome="first_token") == 1
        assert metric_total(split, SEEDED, outcome="mismatch") == 0


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 0.9, "top_p": 0.9, "seed": 11, "n": 2},
        {"logprobs": 2},
        {"temperature": 1.0, "seed": 5, "logprobs": 1, "max_tokens": 4},
    ],
    ids=["greedy", "seeded", "n-seeded", "logprobs", "seeded-logprobs"],
)
def test_streams_match_the_aggregated_path(
    split: httpx.Client, aggregated: httpx.Client, fields: dict[str, Any]
) -> None:
    body = completion(**fields)
    ours, theirs = completion_chunks(split, body), completion_chunks(aggregated, body)
    assert choices(ours) == choices(theirs)
    assert usage(ours) == usage(theirs)
    assert metric_total(split, SEEDED, outcome="mismatch") == 0


def test_a_stop_string_the_first_token_completes_ends_the_answer_at_the_prefill(
    pair: Pair, split: httpx.Client, aggregated: httpx.Client
) -> None:
    first = choices(completion_chunks(aggregated, completion(max_tokens=1)))[0]["text"]
    assert first
    body = completion(stop=[first])
    ours, theirs = completion_chunks(split, body), completion_chunks(aggregated, body)
    assert choices(ours) == choices(theirs)
    assert choices(ours)[0]["finish"] == "stop"
    assert usage(ours) == usage(theirs)


def test_max_tokens_one_is_answered_by_the_prefill_and_its_kv_is_read_at_once(
    pair: Pair, split: httpx.Client, aggregated: httpx.Client
) -> None:
    released = pair.totals("prefill").transfers_released
    whole = metric_total(split, SEEDED, outcome="whole_answer")
    body = completion(max_tokens=1, logprobs=1)
    ours, theirs = completion_chunks(split, body), completion_chunks(aggregated, body)
    assert choices(ours) == choices(theirs)
    assert usage(ours) == usage(theirs) == {**usage(theirs), "completion_tokens": 1}
    assert metric_total(split, SEEDED, outcome="whole_answer") == whole + 1
    # The decode side reads the prefill's KV and drops it: not held until the lease ends.
    wait_until(
        lambda: pair.totals("prefill").transfers_released != released,
        20,
        "the prefill's KV read",
    )
    assert pair.totals("prefill").transfers_released == released + 1


def test_chat_streams_match_the_aggregated_path(
    split: httpx.Client, aggregated: httpx.Client
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Seed the first token, please."}],
        "max_tokens": 8,
        "temperature": 0.8,
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ours, theirs = stream_chunks(split, body), stream_chunks(aggregated, body)
    assert stream_summary(ours)["text"] == stream_summary(theirs)["text"]
    assert stream_summary(ours)["usage"] == stream_summary(theirs)["usage"]


def test_unseeded_random_sampling_is_not_seeded(split: httpx.Client) -> None:
    """Two engines sampling without a seed draw independently: the prefill's token would not
    be the one the decode continues from, so the decode's stream goes out whole."""
    before = metric_total(split, SEEDED)
    chunks = completion_chunks(split, completion(temperature=1.0))
    assert choices(chunks)[0]["text"]
    assert usage(chunks)["completion_tokens"] == 10
    assert metric_total(split, SEEDED) == before
