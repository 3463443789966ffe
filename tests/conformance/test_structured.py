"""Structured output: the constrained text parses and satisfies its constraint."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer

from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance.helpers import (
    FinishReason,
    Generation,
    make_request,
    prompt_ids,
    rpc_error,
    stream,
    whitespace_bias,
)

pytestmark = pytest.mark.timeout(120)

Decoding = inference_pb2.DecodingParameters
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
PATTERN = "[ab]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta gamma"]


def constrained(
    channel: grpc.Channel, tag: str, decoding: Decoding, max_new_tokens: int = 40
) -> Generation:
    request = make_request(
        prompt_ids(tag, 12), tag=tag, max_new_tokens=max_new_tokens, decoding=decoding
    )
    return stream(channel, request, rank=0)


@pytest.mark.parametrize("tag", ["json-a", "json-b"])
def test_json_schema_output_validates(
    engine_channel: grpc.Channel, tokenizer: Tokenizer, tag: str
) -> None:
    decoding = Decoding(json=json.dumps(SCHEMA), logit_bias=whitespace_bias(tokenizer))
    result = constrained(engine_channel, tag, decoding)
    assert result.reason == FinishReason.STOP, result.text
    value = json.loads(result.text)
    assert set(value) == {"ok", "color"}
    assert isinstance(value["ok"], bool)
    assert value["color"] in {"red", "green"}


def test_invalid_json_schema_is_rejected(engine_channel: grpc.Channel) -> None:
    request = make_request(prompt_ids("json-bad", 8), decoding=Decoding(json="{not json"))
    error = rpc_error(lambda: stream(engine_channel, request, rank=0))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json schema" in (error.details() or "")


@pytest.mark.parametrize("tag", ["regex-a", "regex-b"])
def test_regex_output_matches(engine_channel: grpc.Channel, tag: str) -> None:
    result = constrained(engine_channel, tag, Decoding(regex=PATTERN))
    assert result.reason == FinishReason.STOP
    assert re.fullmatch(PATTERN, result.text), result.text


@pytest.mark.parametrize(("tag", "temperature"), [("choice-a", 0.0), ("choice-b", 1.0)])
def test_choice_output_is_one_of_them(
    engine_channel: grpc.Channel, tag: str, temperature: float
) -> None:
    request = make_request(
        prompt_ids(tag, 12),
        tag=tag,
        max_new_tokens=20,
        temperature=temperature,
        sampling=inference_pb2.RandomSampling(seed=5),
        decoding=Decoding(choice=Decoding.StringChoices(choices=CHOICES)),
    )
    result = stream(engine_channel, request, rank=0)
    assert result.reason == FinishReason.STOP
    assert result.text in CHOICES
