from __future__ import annotations

import math
from typing import Any

import pytest

from rankgate.sidecar.convert import (
    DeltaDecoder,
    RequestEncoder,
    decode_transfer_params,
    encode_transfer_params,
    is_decode_handoff,
    merge_responses,
    wants_logprobs,
)
from rankgate.sidecar.errors import EngineFailure, InvalidRequest
from rankgate.sidecar.routing.hashing import SALT_TAG
from rankgate.sidecar.types import (
    MediaInput,
    OutputOptions,
    PreparedRequest,
    SamplingParams,
    StoppingParams,
    StructuredOutput,
)
from rankgate.wire.proto.vllm import inference_pb2 as pb


def prepared(**overrides: Any) -> PreparedRequest:
    fields: dict[str, Any] = {
        "request_id": "req",
        "prompt_token_ids": (5, 6, 7),
        "sampling": SamplingParams(temperature=1.0),
        "stopping": StoppingParams(max_tokens=16),
    }
    fields.update(overrides)
    return PreparedRequest(**fields)


def encode(**overrides: Any) -> list[Any]:
    return RequestEncoder("served").encode(prepared(**overrides))


def test_minimal_request() -> None:
    (message,) = encode()
    assert message.request_id == "req-0"
    assert message.model == "served"
    assert list(message.token_ids.ids) == [5, 6, 7]
    assert message.HasField("temperature")
    assert message.temperature == 1.0
    assert message.sampling.num_sequences == 0
    assert not message.sampling.HasField("seed")
    assert message.stopping.max_new_tokens == 16
    assert message.response.output_text is True
    assert message.response.output_token_ids is True
    assert message.response.skip_special_tokens is True
    assert not message.response.output_logprobs
    assert not message.HasField("kv")
    assert not message.HasField("decoding")


def test_greedy_temperature_is_still_sent() -> None:
    (message,) = encode(sampling=SamplingParams(temperature=0.0))
    assert message.HasField("temperature")
    assert message.temperature == 0.0


def test_n_fans_out_with_own_ids_and_seeds() -> None:
    messages = encode(n=3, sampling=SamplingParams(temperature=0.7, seed=41, top_p=0.5))
    assert [m.request_id for m in messages] == ["req-0", "req-1", "req-2"]
    assert [m.sampling.seed for m in messages] == [41, 42, 43]
    assert all(m.sampling.num_sequences == 0 for m in messages)
    assert all(math.isclose(m.sampling.top_p, 0.5) for m in messages)


def test_n_without_seed_sends_no_seed() -> None:
    messages = encode(n=2)
    assert not any(m.sampling.HasField("seed") for m in messages)


def test_seed_wraps_at_int64_and_rejects_out_of_range() -> None:
    messages = encode(n=2, sampling=SamplingParams(temperature=1.0, seed=(1 << 63) - 1))
    assert [m.sampling.seed for m in messages] == [(1 << 63) - 1, -(1 << 63)]
    with pytest.raises(InvalidRequest, match="64-bit"):
        encode(sampling=SamplingParams(temperature=1.0, seed=1 << 63))


def test_every_field_is_carried() -> None:
    (message,) = encode(
        sampling=SamplingParams(
            temperature=0.3,
            top_k=5,
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.1,
            logit_bias={7: -2.0},
            allowed_token_ids=(7, 8),
        ),
        stopping=StoppingParams(
            max_tokens=9,
            min_tokens=2,
            stop=("END",),
            stop_token_ids=(3,),
            include_stop_str_in_output=True,
            ignore_eos=True,
        ),
        output=OutputOptions(logprobs=3, prompt_token_ids=True, skip_special_tokens=False),
        structured=StructuredOutput(kind="regex", spec="[a-z]+"),
        cache_salt="tenant-1",
        priority=-2,
        lora_name="adapter",
        kv_transfer_params={"do_remote_decode": True, "remote_port": 8000},
    )
    assert message.sampling.top_k == 5
    assert math.isclose(message.sampling.min_p, 0.1, rel_tol=1e-6)
    decoding = message.decoding
    assert math.isclose(decoding.repetition_penalty, 1.1, rel_tol=1e-6)
    assert dict(decoding.logit_bias) == {7: -2.0}
    assert list(decoding.allowed_token_ids) == [7, 8]
    assert decoding.WhichOneof("structured_output") == "regex"
    assert decoding.regex == "[a-z]+"
    stopping = message.stopping
    assert (stopping.max_new_tokens, stopping.min_new_tokens) == (9, 2)
    assert list(stopping.stop_strings) == ["END"]
    assert list(stopping.stop_token_ids) == [3]
    assert stopping.include_stop_strings
    assert stopping.ignore_eos
    response = message.response
    assert response.output_logprobs
    assert response.output_candidates.top_n == 3
    assert response.prompt_token_ids
    assert response.skip_special_tokens is False
    assert message.kv.cache_salt == SALT_TAG + "tenant-1"
    # JSON types go out as they came: vLLM's NIXL connector refuses strings where it compares.
    params = message.kv.kv_transfer_params
    assert params.fields["remote_port"].WhichOneof("kind") == "number_value"
    assert decode_transfer_params(params) == {"do_remote_decode": True, "remote_port": 8000}
    assert message.priority == -2
    assert message.lora_name == "adapter"


def test_logprobs_zero_asks_for_sampled_logprob_only() -> None:
    (message,) = encode(output=OutputOptions(logprobs=0))
    assert message.response.output_logprobs
    assert not message.response.HasField("output_candidates")


@pytest.mark.parametrize(
    ("structured", "field", "value"),
    [
        (StructuredOutput(kind="json", spec='{"type":"object"}'), "json", '{"type":"object"}'),
        (StructuredOutput(kind="grammar", spec="root ::= x"), "grammar", "root ::= x"),
        (StructuredOutput(kind="structural_tag", spec="{}"), "structural_tag", "{}"),
        (StructuredOutput(kind="json_object"), "json_object", True),
    ],
)
def test_structured_output_oneof(structured: StructuredOutput, field: str, value: Any) -> None:
    (message,) = encode(structured=structured)
    assert message.decoding.WhichOneof("structured_output") == field
    assert getattr(message.decoding, field) == value


def test_choice_constraint() -> None:
    (message,) = encode(structured=StructuredOutput(kind="choice", choices=("yes", "no")))
    assert list(message.decoding.choice.choices) == ["yes", "no"]


def test_text_prompt_and_media() -> None:
    (text,) = encode(prompt_token_ids=(), prompt_text="hello")
    assert text.WhichOneof("prompt") == "text"
    assert text.text == "hello"
    (image,) = encode(
        media=(
            MediaInput(uuid="a" * 64, mime_type="image/png", data=b"\x89PNG"),
            MediaInput(uuid="b" * 64, url="https://example.com/cat.jpg"),
        )
    )
    first, second = image.media
    assert first.modality == pb.MODALITY_IMAGE
    assert first.raw_bytes == b"\x89PNG"
    assert first.mime_type == "image/png"
    assert first.uuid == "a" * 64
    assert second.WhichOneof("source") == "url"
    assert second.uuid == "b" * 64


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n": 0}, "n must be at least 1"),
        ({"prompt_token_ids": ()}, "prompt is empty"),
        (
            {"prompt_token_ids": (), "prompt_text": "x", "media": (MediaInput(uuid="u", url="u"),)},
            "token-id prompt",
        ),
        ({"media": (MediaInput(uuid="u"),)}, "neither bytes nor a URL"),
        ({"media": (MediaInput(uuid="", url="x"),)}, "uuid"),
        ({"prompt_token_ids": (-1,)}, "cannot be encoded"),
        ({"stopping": StoppingParams(max_tokens=-5)}, "cannot be encoded"),
        ({"output": OutputOptions(logprobs=-1)}, "logprobs"),
        ({"structured": StructuredOutput(kind="json")}, "constraint is empty"),
        ({"structured": StructuredOutput(kind="choice")}, "at least one choice"),
    ],
)
def test_bad_input_is_a_clear_invalid_request(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        encode(**overrides)


def test_decode_handoff_detection() -> None:
    assert is_decode_handoff(prepared(kv_transfer_params={"do_remote_prefill": True}))
    assert not is_decode_handoff(prepared(kv_transfer_params={"do_remote_decode": True}))
    assert not is_decode_handoff(prepared())


def test_transfer_params_round_trip() -> None:
    params = {
        "remote_host": "10.0.0.1",
        "remote_port": 8000,
        "remote_block_ids": [1, 2, 3],
        "ratio": 0.5,
        "nested": {"flag": False, "none": None},
    }
    message = pb.KVCacheParameters()
    encode_transfer_params(message.kv_transfer_params, params)
    assert decode_transfer_params(message.kv_transfer_params) == params
    fields = message.kv_transfer_params.fields
    kinds = {key: value.WhichOneof("kind") for key, value in fields.items()}
    assert kinds["remote_port"] == "number_value"
    assert kinds["remote_host"] == "string_value"


def response(**fields: Any) -> Any:
    prompt = fields.pop("prompt_info", None)
    message = pb.GenerateResponse(outputs=pb.SequenceOutput(**fields))
    if prompt is not None:
        message.prompt_info.CopyFrom(prompt)
    return message


def test_decoder_merges_prompt_info_into_first_delta() -> None:
    decoder = DeltaDecoder(index=2, want_logprobs=False)
    assert decoder.feed(response(prompt_info=pb.PromptInfo(num_prompt_tokens=700))) is None
    first = decoder.feed(response(text="Hi", token_ids=[11]))
    assert first is not None
    assert (first.index, first.text, first.token_ids, first.prompt_tokens) == (2, "Hi", (11,), 700)
    second = decoder.feed(response(text="!", token_ids=[12]))
    assert second is not None
    assert second.prompt_tokens is None
    assert second.logprobs is None


def test_decoder_prompt_token_ids() -> None:
    decoder = DeltaDecoder(index=0, want_logprobs=False)
    decoder.feed(response(prompt_info=pb.PromptInfo(num_prompt_tokens=2, token_ids=[4, 5])))
    delta = decoder.feed(response(text="a", token_ids=[9]))
    assert delta is not None
    assert delta.prompt_token_ids == (4, 5)


def test_decoder_logprobs_with_candidates() -> None:
    decoder = DeltaDecoder(index=0, want_logprobs=True)
    candidates = pb.CandidateTokenInfo(
        tokens=[
            pb.CandidateTokenInfo.TokenInfo(id=11, logprob=-0.5, rank=1),
            pb.CandidateTokenInfo.TokenInfo(id=13, logprob=-1.5, rank=2),
        ]
    )
    delta = decoder.feed(
        response(
            text="ab", token_ids=[11, 12], logprobs=[-0.5, -2.0], ranks=[1, 3],
            candidate_tokens=[candidates, pb.CandidateTokenInfo()],
        )
    )  # fmt: skip
    assert delta is not None
    assert delta.logprobs is not None
    first, second = delta.logprobs
    assert (first.token_id, first.logprob, first.rank) == (11, -0.5, 1)
    assert first.top == ((11, -0.5, 1), (13, -1.5, 2))
    assert (second.token_id, second.logprob, second.rank, second.top) == (12, -2.0, 3, ())


@pytest.mark.parametrize(
    ("finish", "reason", "stop_reason"),
    [
        (pb.FinishInfo(finish_reason=pb.FinishInfo.LENGTH, num_output_tokens=4), "length", None),
        (pb.FinishInfo(finish_reason=pb.FinishInfo.STOP, eos_token_id=1), "stop", None),
        (pb.FinishInfo(finish_reason=pb.FinishInfo.STOP, stop_token_id=7), "stop", 7),
        (pb.FinishInfo(finish_reason=pb.FinishInfo.STOP, stop_string="END"), "stop", "END"),
        (pb.FinishInfo(finish_reason=pb.FinishInfo.ABORTED), "abort", None),
    ],
)
def test_decoder_finish(finish: Any, reason: str, stop_reason: object) -> None:
    delta = DeltaDecoder(0, False).feed(response(finish_info=finish))
    assert delta is not None
    assert delta.finish_reason == reason
    assert delta.stop_reason == stop_reason
    assert delta.completion_tokens == finish.num_output_tokens


def test_decoder_forwards_kv_transfer_params() -> None:
    finish = pb.FinishInfo(finish_reason=pb.FinishInfo.LENGTH, num_output_tokens=1)
    finish.kv_transfer_params.update({"remote_port": 8000, "remote_host": "h"})
    delta = DeltaDecoder(0, False).feed(response(token_ids=[3], text="x", finish_info=finish))
    assert delta is not None
    assert delta.kv_transfer_params == {"remote_port": 8000, "remote_host": "h"}


def test_finish_without_reason_is_an_engine_failure() -> None:
    with pytest.raises(EngineFailure):
        DeltaDecoder(0, False).feed(response(finish_info=pb.FinishInfo()))


def test_merged_responses_decode_like_the_messages_one_by_one() -> None:
    finish = pb.FinishInfo(finish_reason=pb.FinishInfo.STOP, stop_string="END")
    finish.num_output_tokens = 3
    messages = [
        response(prompt_info=pb.PromptInfo(num_prompt_tokens=5)),
        response(text="Hel", token_ids=[1], num_tokens=1),
        response(text="", token_ids=[2], num_tokens=1),
        response(text="lo", token_ids=[3], num_tokens=1, finish_info=finish),
    ]
    merged = pb.GenerateResponse()
    merged.CopyFrom(messages[0])
    assert merge_responses(merged, messages[1:])
    delta = DeltaDecoder(0, False).feed(merged)
    assert delta is not None
    assert (delta.text, delta.token_ids, delta.prompt_tokens) == ("Hello", (1, 2, 3), 5)
    assert (delta.finish_reason, delta.stop_reason, delta.completion_tokens) == ("stop", "END", 3)
    assert merged.outputs.num_tokens == 3


_FINISHED = pb.FinishInfo(finish_reason=pb.FinishInfo.LENGTH)


@pytest.mark.parametrize(
    ("into", "more"),
    [
        # Nothing follows a finish; a stream's first message starts a new sequence.
        (response(text="a", finish_info=_FINISHED), [response(text="b")]),
        (response(text="a"), [response(prompt_info=pb.PromptInfo(num_prompt_tokens=1))]),
        (response(text="a"), [response(text="b", finish_info=_FINISHED), response(text="c")]),
        (
            response(text="a"),
            [response(text="b"), response(prompt_info=pb.PromptInfo(num_prompt_tokens=1))],
        ),
    ],
)
def test_responses_that_cannot_merge_are_left_alone(into: Any, more: list[Any]) -> None:
    before = into.SerializeToString()
    assert merge_responses(into, more) is False
    assert into.SerializeToString() == before


@pytest.mark.parametrize(("logprobs", "wanted"), [(None, False), (0, True), (3, True)])
def test_streams_with_logprobs_are_known_from_the_request(
    logprobs: int | None, wanted: bool
) -> None:
    (message,) = RequestEncoder("m").encode(prepared(output=OutputOptions(logprobs=logprobs)))
    assert wants_logprobs(message) is wanted
