"""Stopping criteria: what ends a sequence, what is reported, and what the text keeps."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer

from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance.helpers import (
    EOS_TOKEN_ID,
    FinishReason,
    Generation,
    make_request,
    prompt_ids,
    stream,
)

pytestmark = pytest.mark.timeout(120)

Stopping = inference_pb2.StoppingCriteria
FORCE_EOS = inference_pb2.DecodingParameters(logit_bias={EOS_TOKEN_ID: 100.0})
BASELINE_TOKENS = 12


def baseline(channel: grpc.Channel, tag: str) -> Generation:
    """Greedy output the stop checks are derived from, so they hold for any model."""
    request = make_request(
        prompt_ids(tag, 10),
        tag=tag,
        stopping=Stopping(max_new_tokens=BASELINE_TOKENS, ignore_eos=True),
    )
    return stream(channel, request, rank=0)


def run(channel: grpc.Channel, tag: str, stopping: Stopping, **fields: Any) -> Generation:
    request = make_request(prompt_ids(tag, 10), tag=tag, stopping=stopping, **fields)
    return stream(channel, request, rank=0)


@pytest.mark.parametrize("count", [1, 5])
def test_max_new_tokens_is_exact(engine_channel: grpc.Channel, count: int) -> None:
    result = run(engine_channel, "max-tokens", Stopping(max_new_tokens=count, ignore_eos=True))
    assert result.reason == FinishReason.LENGTH
    assert len(result.token_ids) == count
    assert result.finish is not None
    assert result.finish.num_output_tokens == count
    assert result.stop_kind is None


def test_eos_stops_and_is_reported(engine_channel: grpc.Channel) -> None:
    result = run(engine_channel, "eos", Stopping(max_new_tokens=8), decoding=FORCE_EOS)
    assert result.reason == FinishReason.STOP
    assert result.stop_kind == "eos_token_id"
    assert result.finish is not None
    assert result.finish.eos_token_id == EOS_TOKEN_ID
    # The EOS token is counted and returned; its text is not.
    assert result.token_ids == [EOS_TOKEN_ID]
    assert result.finish.num_output_tokens == 1
    assert result.text == ""


def test_ignore_eos_runs_to_the_limit(engine_channel: grpc.Channel) -> None:
    result = run(
        engine_channel, "eos", Stopping(max_new_tokens=5, ignore_eos=True), decoding=FORCE_EOS
    )
    assert result.reason == FinishReason.LENGTH
    assert result.token_ids == [EOS_TOKEN_ID] * 5


def test_min_new_tokens_defers_eos(engine_channel: grpc.Channel) -> None:
    result = run(
        engine_channel, "eos", Stopping(max_new_tokens=8, min_new_tokens=3), decoding=FORCE_EOS
    )
    assert result.reason == FinishReason.STOP
    assert result.stop_kind == "eos_token_id"
    assert len(result.token_ids) == 4
    assert EOS_TOKEN_ID not in result.token_ids[:3]
    assert result.token_ids[3] == EOS_TOKEN_ID


def test_stop_token_id_stops_and_is_reported(engine_channel: grpc.Channel) -> None:
    base = baseline(engine_channel, "stop-id")
    index = next(
        i for i in range(1, len(base.token_ids)) if base.token_ids[i] not in base.token_ids[:i]
    )
    stop_id = base.token_ids[index]
    result = run(
        engine_channel,
        "stop-id",
        Stopping(max_new_tokens=BASELINE_TOKENS, stop_token_ids=[stop_id]),
    )
    assert result.reason == FinishReason.STOP
    assert result.stop_kind == "stop_token_id"
    assert result.finish is not None
    assert result.finish.stop_token_id == stop_id
    assert result.token_ids == base.token_ids[: index + 1]


def test_min_new_tokens_defers_stop_token_ids(engine_channel: grpc.Channel) -> None:
    base = baseline(engine_channel, "stop-id")
    first = base.token_ids[0]
    result = run(
        engine_channel,
        "stop-id",
        Stopping(max_new_tokens=BASELINE_TOKENS, min_new_tokens=4, stop_token_ids=[first]),
    )
    assert first not in result.token_ids[:4]
    assert len(result.token_ids) >= 4
    # Without min_new_tokens the very first token would have stopped it.
    unguarded = run(
        engine_channel, "stop-id", Stopping(max_new_tokens=BASELINE_TOKENS, stop_token_ids=[first])
    )
    assert unguarded.token_ids == [first]


def stop_string_case(base: Generation, tokenizer: Tokenizer) -> tuple[str, int]:
    """A clean stop string (one token's text) first occurring after the text's start, and where."""
    for token_id in base.token_ids[1:]:
        piece = tokenizer.decode([token_id])
        where = base.text.find(piece)
        if len(piece.strip()) >= 2 and "\ufffd" not in piece and where > 0:
            return piece, where
    pytest.fail(f"no usable stop string in greedy output {base.text!r}")


def test_stop_string_truncates_text(engine_channel: grpc.Channel, tokenizer: Tokenizer) -> None:
    base = baseline(engine_channel, "stop-string")
    stop, where = stop_string_case(base, tokenizer)
    result = run(
        engine_channel, "stop-string", Stopping(max_new_tokens=BASELINE_TOKENS, stop_strings=[stop])
    )
    assert result.reason == FinishReason.STOP
    assert result.stop_kind == "stop_string"
    assert result.finish is not None
    assert result.finish.stop_string == stop
    assert result.text == base.text[:where]
    assert len(result.token_ids) < BASELINE_TOKENS


def test_include_stop_strings_keeps_it(engine_channel: grpc.Channel, tokenizer: Tokenizer) -> None:
    base = baseline(engine_channel, "stop-string")
    stop, where = stop_string_case(base, tokenizer)
    result = run(
        engine_channel,
        "stop-string",
        Stopping(max_new_tokens=BASELINE_TOKENS, stop_strings=[stop], include_stop_strings=True),
    )
    assert result.reason == FinishReason.STOP
    assert result.finish is not None
    assert result.finish.stop_string == stop
    assert result.text == base.text[: where + len(stop)]
