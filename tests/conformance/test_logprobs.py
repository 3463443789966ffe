"""Output logprobs and top-n candidates: one per token, ordered, consistent with the sample."""

from __future__ import annotations

import math

import grpc
import pytest

from sidecar.proto.vllm import inference_pb2
from tests.conformance.helpers import Generation, make_request, prompt_ids, stream

pytestmark = pytest.mark.timeout(120)

NEW_TOKENS = 6
TOP_N = 3


def generate(
    channel: grpc.Channel,
    tag: str,
    response: inference_pb2.ResponseOptions,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
) -> Generation:
    request = make_request(
        prompt_ids(tag, 12),
        tag=tag,
        temperature=temperature,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True),
        sampling=inference_pb2.RandomSampling(seed=seed) if seed is not None else None,
        response=response,
    )
    return stream(channel, request, rank=0)


def options(*, logprobs: bool, top_n: int | None = None) -> inference_pb2.ResponseOptions:
    response = inference_pb2.ResponseOptions(
        output_text=True, output_token_ids=True, output_logprobs=logprobs
    )
    if top_n is not None:
        response.output_candidates.top_n = top_n
    return response


def test_no_logprobs_unless_asked(engine_channel: grpc.Channel) -> None:
    result = generate(engine_channel, "logprobs", options(logprobs=False))
    assert result.logprobs == []
    assert result.ranks == []
    assert result.candidates == []


def test_one_logprob_and_rank_per_token(engine_channel: grpc.Channel) -> None:
    result = generate(engine_channel, "logprobs", options(logprobs=True))
    for message in result.messages[1:]:
        assert len(message.outputs.logprobs) == len(message.outputs.token_ids)
        assert len(message.outputs.ranks) == len(message.outputs.token_ids)
    assert len(result.logprobs) == NEW_TOKENS
    assert all(value <= 0.0 and math.isfinite(value) for value in result.logprobs)
    # Greedy picks the most likely token: rank 1 everywhere.
    assert result.ranks == [1] * NEW_TOKENS


def test_candidates_greedy(engine_channel: grpc.Channel) -> None:
    result = generate(engine_channel, "candidates", options(logprobs=True, top_n=TOP_N))
    assert len(result.candidates) == NEW_TOKENS
    for token, logprob, info in zip(
        result.token_ids, result.logprobs, result.candidates, strict=True
    ):
        assert len(info.tokens) == TOP_N
        values = [candidate.logprob for candidate in info.tokens]
        assert values == sorted(values, reverse=True)
        assert [candidate.rank for candidate in info.tokens] == list(range(1, TOP_N + 1))
        assert info.tokens[0].id == token
        assert info.tokens[0].logprob == pytest.approx(logprob, abs=1e-5)


def test_candidates_sampled(engine_channel: grpc.Channel) -> None:
    """A sampled token is listed exactly when its rank is within top_n; the list never grows."""
    result = generate(
        engine_channel,
        "candidates-sampled",
        options(logprobs=True, top_n=TOP_N),
        temperature=1.0,
        seed=7,
    )
    assert len(result.candidates) == NEW_TOKENS
    outside = 0
    for token, logprob, rank, info in zip(
        result.token_ids, result.logprobs, result.ranks, result.candidates, strict=True
    ):
        assert len(info.tokens) == TOP_N
        listed = {candidate.id: candidate for candidate in info.tokens}
        if rank <= TOP_N:
            assert listed[token].rank == rank
            assert listed[token].logprob == pytest.approx(logprob, abs=1e-5)
        else:
            outside += 1
            assert token not in listed
            assert logprob <= info.tokens[-1].logprob
    # A near-uniform random model samples outside the top 3 almost always: the branch is real.
    assert outside > 0


def test_candidates_need_output_logprobs(engine_channel: grpc.Channel) -> None:
    """vLLM sends no candidates unless output_logprobs is also set."""
    result = generate(engine_channel, "candidates", options(logprobs=False, top_n=TOP_N))
    assert result.candidates == []
    assert result.logprobs == []
