"""The shape of Generate and GenerateStream: what arrives, in which message, in which order."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer

from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance.helpers import (
    FinishReason,
    fold,
    make_request,
    prompt_ids,
    stream,
    unary,
)

pytestmark = pytest.mark.timeout(120)

NEW_TOKENS = 6


def fixed_length(prompt: list[int], tag: str, **fields: Any) -> inference_pb2.GenerateRequest:
    """EOS cannot cut these short, so the token count is known in advance."""
    return make_request(
        prompt,
        tag=tag,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True),
        **fields,
    )


def test_stream_starts_with_prompt_info_only(engine_channel: grpc.Channel) -> None:
    prompt = prompt_ids("shape-first", 11)
    first = stream(engine_channel, fixed_length(prompt, "shape-first"), rank=0).messages[0]
    assert first.HasField("prompt_info")
    assert first.prompt_info.num_prompt_tokens == len(prompt)
    assert not first.outputs.token_ids
    assert not first.outputs.text
    assert not first.outputs.HasField("finish_info")


def test_stream_deltas_then_finish_last(engine_channel: grpc.Channel, tokenizer: Tokenizer) -> None:
    prompt = prompt_ids("shape-deltas", 13)
    result = stream(engine_channel, fixed_length(prompt, "shape-deltas"), rank=0)
    deltas = result.messages[1:]
    assert deltas, "no output after prompt_info"
    for delta in deltas:
        assert not delta.HasField("prompt_info")
        assert delta.outputs.token_ids, "a delta without tokens"
        assert delta.outputs.num_tokens == len(delta.outputs.token_ids)
    assert all(not delta.outputs.HasField("finish_info") for delta in deltas[:-1])
    finish = deltas[-1].outputs.finish_info
    assert deltas[-1].outputs.HasField("finish_info")
    assert finish.finish_reason == FinishReason.LENGTH
    assert finish.num_output_tokens == NEW_TOKENS == len(result.token_ids)
    assert result.text == tokenizer.decode(result.token_ids)


def test_prompt_token_ids_only_when_asked(engine_channel: grpc.Channel) -> None:
    prompt = prompt_ids("shape-prompt-ids", 9)
    asked = fixed_length(
        prompt,
        "shape-prompt-ids",
        response=inference_pb2.ResponseOptions(
            prompt_token_ids=True, output_text=True, output_token_ids=True
        ),
    )
    first = stream(engine_channel, asked, rank=0).messages[0]
    assert list(first.prompt_info.token_ids) == prompt
    plain = stream(engine_channel, fixed_length(prompt, "shape-prompt-ids"), rank=0).messages[0]
    assert list(plain.prompt_info.token_ids) == []


def test_output_token_ids_only_when_asked(engine_channel: grpc.Channel) -> None:
    prompt = prompt_ids("shape-output-ids", 9)
    request = fixed_length(
        prompt, "shape-output-ids", response=inference_pb2.ResponseOptions(output_text=True)
    )
    result = stream(engine_channel, request, rank=0)
    assert result.token_ids == []
    assert result.text
    assert result.finish is not None
    assert result.finish.num_output_tokens == NEW_TOKENS


def test_unary_returns_the_whole_output(engine_channel: grpc.Channel) -> None:
    prompt = prompt_ids("shape-unary", 12)
    streamed = stream(engine_channel, fixed_length(prompt, "shape-unary"), rank=0)
    reply = unary(engine_channel, fixed_length(prompt, "shape-unary"), rank=0)
    assert reply.prompt_info.num_prompt_tokens == len(prompt)
    assert list(reply.outputs.token_ids) == streamed.token_ids
    assert reply.outputs.num_tokens == NEW_TOKENS
    assert reply.outputs.text == streamed.text
    assert reply.outputs.finish_info.finish_reason == FinishReason.LENGTH
    assert reply.outputs.finish_info.num_output_tokens == NEW_TOKENS


def test_text_prompt_is_tokenized_without_added_tokens(
    engine_channel: grpc.Channel, tokenizer: Tokenizer
) -> None:
    text = "hello world, this is a conformance check"
    request = inference_pb2.GenerateRequest(
        request_id="conf-text-prompt",
        text=text,
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
        response=inference_pb2.ResponseOptions(prompt_token_ids=True, output_token_ids=True),
    )
    result = fold([unary(engine_channel, request, rank=0)])
    expected = tokenizer.encode(text, add_special_tokens=False).ids
    assert list(result.messages[0].prompt_info.token_ids) == expected
    assert len(result.token_ids) == 2
