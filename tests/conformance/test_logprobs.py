"""Output logprobs and top-n candidates: one per token, ordered, consistent with the sample."""

from __future__ import annotations

import math

import grpc
import pytest

from rankgate.wire.proto.vllm import inference_pb2
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


# ---------------------------------------------------------------- prompt logprobs

PROMPT_LEN = 10


def prompt_info(
    channel: grpc.Channel, tag: str, response: inference_pb2.ResponseOptions, prompt: list[int]
) -> inference_pb2.PromptInfo:
    request = make_request(prompt, tag=tag, max_new_tokens=1, response=response)
    result = stream(channel, request, rank=0)
    assert result.messages[0].HasField("prompt_info")
    return result.messages[0].prompt_info


def prompt_options(
    *, top_n: int | None = None, logprobs: bool = True
) -> inference_pb2.ResponseOptions:
    response = inference_pb2.ResponseOptions(
        output_text=True, output_token_ids=True, prompt_logprobs=logprobs
    )
    if top_n is not None:
        response.prompt_candidates.top_n = top_n
    return response


def test_prompt_logprobs_one_per_prompt_token(engine_channel: grpc.Channel) -> None:
    """A placeholder for the first token (0.0, rank 0, no candidates), then one entry each."""
    prompt = prompt_ids("prompt-logprobs", PROMPT_LEN)
    info = prompt_info(engine_channel, "prompt-logprobs", prompt_options(), prompt)
    assert info.num_prompt_tokens == PROMPT_LEN
    # Ids come back only when asked for: a gateway pairing values with ids must ask.
    assert list(info.token_ids) == []
    assert len(info.logprobs) == len(info.ranks) == len(info.candidate_tokens) == PROMPT_LEN
    assert info.logprobs[0] == 0.0
    assert info.ranks[0] == 0
    assert all(value < 0.0 and math.isfinite(value) for value in info.logprobs[1:])
    assert all(rank >= 1 for rank in info.ranks[1:])
    assert all(len(entry.tokens) == 0 for entry in info.candidate_tokens)


def test_prompt_candidates(engine_channel: grpc.Channel) -> None:
    """top_n candidates per prompt position, ranked; the prompt's own token is among them
    exactly when its rank is within top_n."""
    prompt = prompt_ids("prompt-candidates", PROMPT_LEN)
    response = prompt_options(top_n=TOP_N)
    response.prompt_token_ids = True
    info = prompt_info(engine_channel, "prompt-candidates", response, prompt)
    assert list(info.token_ids) == prompt
    assert len(info.candidate_tokens[0].tokens) == 0
    for token, logprob, rank, entry in list(
        zip(prompt, info.logprobs, info.ranks, info.candidate_tokens, strict=True)
    )[1:]:
        assert [candidate.rank for candidate in entry.tokens] == list(range(1, TOP_N + 1))
        values = [candidate.logprob for candidate in entry.tokens]
        assert values == sorted(values, reverse=True)
        listed = {candidate.id: candidate for candidate in entry.tokens}
        if rank <= TOP_N:
            assert listed[token].logprob == pytest.approx(logprob, abs=1e-5)
        else:
            assert token not in listed
            assert logprob <= values[-1]


def test_prompt_candidates_need_prompt_logprobs(engine_channel: grpc.Channel) -> None:
    prompt = prompt_ids("prompt-candidates-alone", PROMPT_LEN)
    response = prompt_options(top_n=TOP_N, logprobs=False)
    info = prompt_info(engine_channel, "prompt-candidates-alone", response, prompt)
    assert list(info.logprobs) == []
    assert list(info.candidate_tokens) == []


def test_prompt_logprobs_score_what_the_model_generates(engine_channel: grpc.Channel) -> None:
    """The logprob of a greedy output token equals its prompt logprob once it is appended to
    the prompt: both are the one model's, whichever pass computed them."""
    prompt = prompt_ids("prompt-vs-output", PROMPT_LEN)
    first = generate_one(engine_channel, prompt)
    token, logprob = first.token_ids[0], first.logprobs[0]
    info = prompt_info(engine_channel, "prompt-vs-output", prompt_options(), [*prompt, token])
    assert info.ranks[-1] == 1
    assert info.logprobs[-1] == pytest.approx(logprob, abs=1e-3)


def generate_one(channel: grpc.Channel, prompt: list[int]) -> Generation:
    request = make_request(
        prompt, tag="prompt-vs-output", max_new_tokens=1, response=options(logprobs=True)
    )
    return stream(channel, request, rank=0)
