"""Response bodies, exactly as OpenAI shapes them (plus vLLM's ``stop_reason``).

Non-streaming responses are encoded from these Structs; the streaming path writes the same
shapes from pre-encoded fragments (``rankgate.app.respond.stream``) and the tests check both agree.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct, UnsetType


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCallOut(Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(Struct, kw_only=True):
    id: str
    function: FunctionCallOut
    type: Literal["function"] = "function"


class ChatMessageOut(Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType | None = UNSET


class ToolCallDeltaFunction(Struct, kw_only=True):
    name: str | UnsetType = UNSET
    arguments: str = ""


class ToolCallDelta(Struct, kw_only=True):
    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: ToolCallDeltaFunction


class ChatDelta(Struct, kw_only=True):
    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    """One SSE event of a streamed chat completion (documentation and tests)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType | None = UNSET


class PromptLogprob(Struct, kw_only=True):
    """One candidate of one prompt position in vLLM's ``prompt_logprobs`` (keyed by id)."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's ``prompt_logprobs``: null for the first token, then the token itself and the top
# candidates, each keyed by its token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | UnsetType | None = UNSET


class Completion(Struct, kw_only=True):
    """A completion, and also the shape of each streamed completion chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | UnsetType = UNSET


class ModelObject(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ErrorDetail(Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorDetail


class Health(Struct, kw_only=True):
    status: str


class Readiness(Struct, kw_only=True):
    ready: bool
    model: str | None
    engine_version: str | None
    dp_size: int | None


class Version(Struct, kw_only=True):
    version: str
    engine_version: str | None
