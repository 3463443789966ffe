"""Request bodies of the OpenAI endpoints, with vLLM's extensions that Rankgate honours.

Structs forbid unknown fields, so the common decode is one strict pass and the strict mode
(``--reject-unknown-fields``) can name a misspelt parameter in a 400; by default
:mod:`rankgate.app.schemas.unknown_fields` drops and logs them afterwards, as vLLM does. Range
limits live in the types (``Meta``), which makes msgspec reject them while decoding and publishes
them in the OpenAPI schema at once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0, le=2**32 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
ChoiceCount = Annotated[int, Meta(ge=1, le=128)]
StopList = Annotated[list[str], Meta(max_length=64)]
NonEmpty = Annotated[str, Meta(min_length=1)]

_STRICT = {"forbid_unknown_fields": True, "kw_only": True}


# ---- content parts -------------------------------------------------------------------------


class TextPart(Struct, tag_field="type", tag="text", **_STRICT):
    text: str


class ImageUrl(Struct, **_STRICT):
    url: NonEmpty
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(Struct, tag_field="type", tag="image_url", **_STRICT):
    image_url: ImageUrl
    uuid: str | None = None


# A format names the container of ``input_audio`` data; it becomes part of a data: URI.
AudioFormat = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9.+-]{0,15}$")]


class InputAudio(Struct, **_STRICT):
    data: NonEmpty
    format: AudioFormat


class InputAudioPart(Struct, tag_field="type", tag="input_audio", **_STRICT):
    input_audio: InputAudio
    uuid: str | None = None


class MediaUrl(Struct, **_STRICT):
    url: NonEmpty


class AudioUrlPart(Struct, tag_field="type", tag="audio_url", **_STRICT):
    audio_url: MediaUrl
    uuid: str | None = None


class VideoUrlPart(Struct, tag_field="type", tag="video_url", **_STRICT):
    video_url: MediaUrl
    uuid: str | None = None


class RefusalPart(Struct, tag_field="type", tag="refusal", **_STRICT):
    refusal: str


UserPart = TextPart | ImageUrlPart | InputAudioPart | AudioUrlPart | VideoUrlPart
AssistantPart = TextPart | RefusalPart


# ---- messages ------------------------------------------------------------------------------


class FunctionCall(Struct, **_STRICT):
    name: NonEmpty
    arguments: str


class ToolCall(Struct, **_STRICT):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class SystemMessage(Struct, tag_field="role", tag="system", **_STRICT):
    content: str | list[TextPart]
    name: str | None = None


class DeveloperMessage(Struct, tag_field="role", tag="developer", **_STRICT):
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(Struct, tag_field="role", tag="user", **_STRICT):
    content: str | list[UserPart]
    name: str | None = None


class AssistantMessage(Struct, tag_field="role", tag="assistant", **_STRICT):
    content: str | list[AssistantPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ToolMessage(Struct, tag_field="role", tag="tool", **_STRICT):
    content: str | list[TextPart]
    tool_call_id: str


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


# ---- tools, formats, options ---------------------------------------------------------------


class FunctionDefinition(Struct, omit_defaults=True, **_STRICT):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, **_STRICT):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Struct, **_STRICT):
    name: NonEmpty


class NamedToolChoice(Struct, **_STRICT):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ResponseFormatText(Struct, tag_field="type", tag="text", **_STRICT):
    pass


class ResponseFormatJsonObject(Struct, tag_field="type", tag="json_object", **_STRICT):
    pass


class JsonSchemaSpec(Struct, **_STRICT):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormatJsonSchema(Struct, tag_field="type", tag="json_schema", **_STRICT):
    json_schema: JsonSchemaSpec


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class StructuredOutputs(Struct, **_STRICT):
    """vLLM's ``structured_outputs`` extension: exactly one constraint."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class StreamOptions(Struct, **_STRICT):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


class SamplingFields(Struct, **_STRICT):
    """Fields shared by both endpoints, in the order the docs table lists them."""

    model: str
    max_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[TokenId, Bias] | None = None
    allowed_token_ids: list[TokenId] | None = None
    stop: str | StopList | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    n: ChoiceCount = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: NonEmpty | None = None
    priority: int = 0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: PosInt | None = None
    kv_transfer_params: dict[str, Any] | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    # Pins a data-parallel rank, like the ``x-data-parallel-rank`` header (Rankgate extension).
    data_parallel_rank: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    return_tokens_as_token_ids: bool = False
    add_special_tokens: bool | None = None
    # vLLM's: candidates per prompt token (not with ``stream``); see prompt_logprobs_of.
    prompt_logprobs: int | None = None
    # OpenAI's: names the conversation, which the kv policy keeps on one rank
    # (rankgate.app.edge.affinity).
    prompt_cache_key: str | None = None
    # OpenAI fields accepted for compatibility that change nothing here.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    # Known fields Rankgate refuses with a clear 400 (rather than "unrecognized").
    use_beam_search: bool | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    vllm_xargs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields, **_STRICT):
    messages: Annotated[list[Message], Meta(min_length=1)]  # type: ignore[misc]
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None
    # vLLM's per-request media knobs: refused unless empty (gRPC has no field for them).
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # Refused when set; see docs/openai-fields.md.
    functions: list[Any] | None = None
    function_call: Any | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    chat_template: str | None = None
    echo: bool | None = None
    verbosity: str | None = None


class CompletionRequest(SamplingFields, **_STRICT):
    # A string, a token array, or a non-empty list of either (a batch); checked in prepare/.
    prompt: Annotated[  # type: ignore[misc]
        str | list[Any],
        Meta(
            extra_json_schema={
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "array",
                            "items": {"type": "integer", "minimum": 0},
                            "minItems": 1,
                        },
                    },
                ]
            }
        ),
    ]
    # 0 only with ``echo``: the prompt alone, scored (what lm-eval's loglikelihood asks).
    max_tokens: NonNegInt | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: PosInt | None = None
    suffix: str | None = None
    prompt_embeds: Any | None = None


CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
