"""Prompt logprobs through the gateway, on the mocker and on real vLLM: ``echo`` with
``logprobs`` (what lm-eval's loglikelihood tasks send), ``max_tokens: 0`` and
``prompt_logprobs``. The values must be the engine's own, never recomputed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.wire.proto.vllm import inference_pb2
from tests.app.serving import serve_app
from tests.conformance.helpers import make_request, prompt_ids, stream
from tests.support.engines import EngineUnderTest

pytestmark = pytest.mark.timeout(300)

TOKENS = prompt_ids("gateway-prompt-logprobs", 9)


@pytest.fixture(scope="module")
def gateway(engine: EngineUnderTest) -> Iterator[httpx.Client]:
    settings = GatewaySettings(engine=engine.target, tokenizer=str(engine.tokenizer_dir))
    with (
        serve_app(create_app(settings), timeout=300) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        yield client


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def completion(engine: EngineUnderTest, **fields: Any) -> dict[str, Any]:
    return {"model": engine.served_model_name, "temperature": 0.0, **fields}


def engine_prompt_logprobs(channel: grpc.Channel, prompt: list[int], top_n: int) -> list[Any]:
    """The engine's own prompt logprobs, asked for over gRPC: (logprob, rank, candidates)."""
    response = inference_pb2.ResponseOptions(output_text=True, prompt_logprobs=True)
    response.prompt_candidates.top_n = top_n
    result = stream(channel, make_request(prompt, max_new_tokens=1, response=response), rank=0)
    info = result.messages[0].prompt_info
    return [
        (
            info.logprobs[i],
            info.ranks[i],
            {t.id: t.logprob for t in info.candidate_tokens[i].tokens},
        )
        for i in range(1, len(prompt))
    ]


def test_echo_with_max_tokens_0_scores_the_prompt(
    engine: EngineUnderTest, gateway: httpx.Client, engine_channel: grpc.Channel
) -> None:
    """lm-eval's loglikelihood request: the prompt alone, each token scored by the engine."""
    body = completion(engine, prompt=TOKENS, echo=True, logprobs=1, max_tokens=0)
    choice = post(gateway, "/v1/completions", body)["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(TOKENS)
    assert choice["text"] == "".join(logprobs["tokens"]) or choice["text"].endswith(
        "".join(logprobs["tokens"][1:])
    )
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    expected = engine_prompt_logprobs(engine_channel, TOKENS, 1)
    for got, top, (value, rank, candidates) in zip(
        logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], expected, strict=True
    ):
        assert got == pytest.approx(value, abs=1e-5)
        # The token itself, and the top candidate when that is another token.
        assert len(top) == (1 if rank == 1 else 2)
        assert max(top.values()) == pytest.approx(max(candidates.values()), abs=1e-5)
    assert choice["finish_reason"] == "length"
    assert len(choice["prompt_logprobs"]) == len(TOKENS)


def test_echo_with_output_puts_the_prompt_first(
    engine: EngineUnderTest, gateway: httpx.Client
) -> None:
    body = completion(engine, prompt=TOKENS, echo=True, logprobs=2, max_tokens=3, ignore_eos=True)
    result = post(gateway, "/v1/completions", body)
    choice = result["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(TOKENS) + 3
    assert logprobs["token_logprobs"][0] is None
    assert all(value is not None for value in logprobs["token_logprobs"][1:])
    assert result["usage"]["completion_tokens"] == 3
    alone = completion(engine, prompt=TOKENS, logprobs=2, max_tokens=3, ignore_eos=True)
    output = post(gateway, "/v1/completions", alone)["choices"][0]
    assert choice["text"].endswith(output["text"])
    assert logprobs["token_logprobs"][len(TOKENS) :] == pytest.approx(
        output["logprobs"]["token_logprobs"], abs=1e-4
    )


def test_prompt_logprobs_field(engine: EngineUnderTest, gateway: httpx.Client) -> None:
    """vLLM's ``prompt_logprobs``: null first, then the token and its top candidates by id."""
    body = completion(engine, prompt=TOKENS, prompt_logprobs=2, max_tokens=1)
    choice = post(gateway, "/v1/completions", body)["choices"][0]
    assert choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert entries[0] is None
    assert len(entries) == len(TOKENS)
    for token, entry in zip(TOKENS[1:], entries[1:], strict=True):
        assert str(token) in entry
        assert 2 <= len(entry) <= 3
        ranks = sorted(item["rank"] for item in entry.values())
        assert ranks[:2] == [1, 2]
        assert all(math.isfinite(item["logprob"]) for item in entry.values())
        assert all(isinstance(item["decoded_token"], str) for item in entry.values())


def test_batch_n_and_text_prompts(engine: EngineUnderTest, gateway: httpx.Client) -> None:
    prompts = ["The sea is calm", "Waves break on the shore tonight"]
    body = completion(
        engine, prompt=prompts, n=2, echo=True, logprobs=0, max_tokens=1, ignore_eos=True
    )
    result = post(gateway, "/v1/completions", body)
    choices = result["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    lengths = []
    for choice in choices:
        prompt = prompts[choice["index"] // 2]
        assert choice["text"].startswith(prompt)
        entries = choice["prompt_logprobs"]
        assert entries[0] is None
        assert len(choice["logprobs"]["tokens"]) == len(entries) + 1
        lengths.append(len(entries))
    assert lengths[0] == lengths[1] < lengths[2] == lengths[3]
    # Both choices of a prompt score it alike: the values are the engine's, not sampled.
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert result["usage"]["prompt_tokens"] == lengths[0] + lengths[2]


def test_streamed_echo_leads_with_the_prompt(
    engine: EngineUnderTest, gateway: httpx.Client
) -> None:
    base = completion(engine, prompt=TOKENS, echo=True, logprobs=1, max_tokens=2, ignore_eos=True)
    whole = post(gateway, "/v1/completions", base)["choices"][0]
    tokens: list[str] = []
    values: list[float | None] = []
    text = ""
    with gateway.stream("POST", "/v1/completions", json={**base, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"]
                if choice["logprobs"]:
                    tokens.extend(choice["logprobs"]["tokens"])
                    values.extend(choice["logprobs"]["token_logprobs"])
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"]
    assert values[0] is None
    assert values[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_chat_prompt_logprobs(engine: EngineUnderTest, gateway: httpx.Client) -> None:
    body = {
        "model": engine.served_model_name,
        "messages": [{"role": "user", "content": "Say something about the sea."}],
        "prompt_logprobs": 1,
        "max_tokens": 2,
        "temperature": 0.0,
    }
    result = post(gateway, "/v1/chat/completions", body)
    entries = result["prompt_logprobs"]
    assert entries[0] is None
    assert len(entries) == result["usage"]["prompt_tokens"]
    assert all(1 <= len(entry) <= 2 for entry in entries[1:])


@pytest.mark.real_vllm
def test_agrees_with_vllms_own_server(real_vllm: EngineUnderTest) -> None:
    """The same loglikelihood requests through the gateway and to vLLM's own HTTP server on
    the same engine give the same logprobs, so an evaluation scores the same either way."""
    engine = real_vllm
    settings = GatewaySettings(engine=engine.target, tokenizer=str(engine.tokenizer_dir))
    with (
        serve_app(create_app(settings), timeout=300) as url,
        httpx.Client(base_url=url, timeout=120) as gateway,
    ):
        compare_with_vllm(engine, gateway)


def compare_with_vllm(engine: EngineUnderTest, gateway: httpx.Client) -> None:
    for prompt in (TOKENS, "The capital of France is Paris"):
        body = completion(engine, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
        ours = post(gateway, "/v1/completions", body)["choices"][0]
        response = httpx.post(f"{engine.http_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        theirs = response.json()["choices"][0]
        assert ours["text"] == theirs["text"]
        mine, vllm = ours["logprobs"], theirs["logprobs"]
        assert mine["tokens"][1:] == vllm["tokens"][1:]
        assert mine["token_logprobs"][0] is None is vllm["token_logprobs"][0]
        assert mine["token_logprobs"][1:] == pytest.approx(vllm["token_logprobs"][1:], abs=1e-4)
        for a, b in zip(mine["top_logprobs"][1:], vllm["top_logprobs"][1:], strict=True):
            assert sorted(a.values()) == pytest.approx(sorted(b.values()), abs=1e-4)
            # One known difference: vLLM's Rust frontend names a special token "" in
            # logprobs, where vLLM's Python server (and the gateway) write its text.
            assert {k for k in a if not is_special(k)} == {k for k in b if k}


def is_special(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")
