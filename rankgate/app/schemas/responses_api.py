"""The Responses API (``/v1/responses``): request items and the response object, as OpenAI
shapes them, with vLLM's sampling extensions.

Input items are decoded one by one (:func:`rankgate.app.prepare.responses.input_items`), because a
message item may leave out its ``type``; the request schema still lists every accepted item.
Everything else decodes straight into these Structs, which forbid unknown fields like the
chat ones do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from rankgate.app.schemas.requests import (
    NonEmpty,
    NonNegInt,
    Penalty,
    PosInt,
    RepetitionPenalty,
    StopList,
    StructuredOutputs,
    Temperature,
    TokenId,
    TopP,
    Unit,
)

_STRICT = {"forbid_unknown_fields": True, "kw_only": True}
_REF = "#/components/schemas/{name}"
ItemStatus = Literal["in_progress", "completed", "incomplete"]
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]

# ---- input items ---------------------------------------------------------------------------


class InputText(Struct, tag_field="type", tag="input_text", **_STRICT):
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputImage(Struct, tag_field="type", tag="input_image", **_STRICT):
    image_url: NonEmpty | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputAudioData(Struct, **_STRICT):
    data: NonEmpty
    format: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9.+-]{0,15}$")]


class InputAudioContent(Struct, tag_field="type", tag="input_audio", **_STRICT):
    input_audio: InputAudioData


class OutputText(Struct, tag_field="type", tag="output_text", **_STRICT):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class Refusal(Struct, tag_field="type", tag="refusal", **_STRICT):
    refusal: str


class ReasoningText(Struct, tag_field="type", tag="reasoning_text", **_STRICT):
    text: str


class SummaryText(Struct, tag_field="type", tag="summary_text", **_STRICT):
    text: str


ContentPart = InputText | InputImage | InputAudioContent | OutputText | Refusal


class MessageItem(Struct, **_STRICT):
    """A message: ``EasyInputMessage``, an input message, or an earlier output message."""

    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Struct, **_STRICT):
    """A function call the model made earlier, sent back as conversation history."""

    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None


class FunctionCallOutputItem(Struct, **_STRICT):
    """The caller's result for a function call, fed back to the model."""

    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None
    name: str | None = None


class ReasoningItem(Struct, **_STRICT):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
INPUT_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "anyOf": [{"$ref": _REF.format(name=t.__name__)} for t in INPUT_ITEM_TYPES.values()]
            },
        },
    ]
}

# ---- tools, formats, options ---------------------------------------------------------------


class FunctionTool(Struct, tag_field="type", tag="function", omit_defaults=True, **_STRICT):
    name: FunctionName
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ToolChoiceFunction(Struct, tag_field="type", tag="function", **_STRICT):
    name: NonEmpty


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class FormatText(Struct, tag_field="type", tag="text", **_STRICT):
    pass


class FormatJsonObject(Struct, tag_field="type", tag="json_object", **_STRICT):
    pass


class FormatJsonSchema(Struct, tag_field="type", tag="json_schema", omit_defaults=True, **_STRICT):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormat = FormatText | FormatJsonObject | FormatJsonSchema


class TextConfig(Struct, **_STRICT):
    format: TextFormat = msgspec.field(default_factory=FormatText)
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Struct, **_STRICT):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Struct, **_STRICT):
    include_obfuscation: bool | None = None


class ResponsesRequest(Struct, **_STRICT):
    model: str
    input: Annotated[str | list[dict[str, Any]], Meta(extra_json_schema=_INPUT_SCHEMA)]
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: NonEmpty | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # vLLM's extensions, as on its own /v1/responses.
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: str | StopList | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: NonEmpty | None = None
    priority: int = 0
    request_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    data_parallel_rank: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    # Known fields Rankgate refuses with a 400 naming them (see docs/openai-fields.md).
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[Any] | None = None
    prompt_cache_retention: str | None = None
    logit_bias: dict[str, float] | None = None
    vllm_xargs: dict[str, Any] | None = None


RESPONSES_DECODER = msgspec.json.Decoder(ResponsesRequest)

# ---- the response --------------------------------------------------------------------------


class OutputTextOut(Struct, tag_field="type", tag="output_text", kw_only=True):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningTextOut(Struct, tag_field="type", tag="reasoning_text", kw_only=True):
    text: str


class MessageOut(Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: ItemStatus
    content: list[OutputTextOut]
    role: Literal["assistant"] = "assistant"


class ReasoningOut(Struct, tag_field="type", tag="reasoning", kw_only=True):
    id: str
    content: list[ReasoningTextOut]
    summary: list[Any] = []
    status: ItemStatus | None = None


class FunctionCallOut(Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = MessageOut | ReasoningOut | FunctionCallOut


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(Struct, kw_only=True):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseErrorOut(Struct, kw_only=True):
    code: str
    message: str


class ReasoningOptions(Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class ResponseObject(Struct, kw_only=True):
    """The ``response`` object: the reply, what ``GET /v1/responses/{id}`` returns, and the
    payload of the stream's lifecycle events."""

    id: str
    created_at: int
    model: str
    status: Literal["completed", "failed", "in_progress", "cancelled", "incomplete"]
    output: list[OutputItem]
    object: Literal["response"] = "response"
    background: bool = False
    error: ResponseErrorOut | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOptions | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: ToolChoice = "auto"
    tools: list[FunctionTool] = []
    top_p: float = 1.0
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class ResponseStreamEvent(Struct, kw_only=True):
    """One server-sent event of a streamed response (for the OpenAPI document; the stream
    writes these shapes from pre-encoded fragments). Fields besides ``type`` and
    ``sequence_number`` depend on the type."""

    type: str
    sequence_number: int


class ResponseDeleted(Struct, kw_only=True):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
