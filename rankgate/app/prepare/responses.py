"""A Responses API request as the chat request it stands for.

``/v1/responses`` is served by the chat pipeline: its input items (plus the stored
conversation a ``previous_response_id`` names) become chat messages, its options the chat
fields they mean, and :class:`~rankgate.app.prepare.chat.ChatPreparer` renders, tokenizes and builds
the engine request exactly as for ``/v1/chat/completions``. Errors the chat side raises name
chat fields; :func:`renamed` points them back at the Responses fields the client sent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import orjson

from rankgate.app.errors import ApiError, from_decode_error, invalid, unsupported
from rankgate.app.schemas.requests import (
    AssistantMessage,
    ChatCompletionRequest,
    DeveloperMessage,
    FunctionCall,
    FunctionDefinition,
    ImageUrl,
    ImageUrlPart,
    InputAudio,
    InputAudioPart,
    JsonSchemaSpec,
    Message,
    NamedFunction,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SystemMessage,
    TextPart,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
    UserPart,
)
from rankgate.app.schemas.responses_api import (
    INPUT_ITEM_TYPES,
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputAudioContent,
    InputImage,
    InputItem,
    InputText,
    MessageItem,
    OutputText,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    ToolChoiceFunction,
)
from rankgate.app.schemas.unknown_fields import convert_ignoring_unknown, unknown_field

_REFUSED = (
    ("background", "is not supported: responses run within the request (send false or omit it)"),
    ("prompt", "is not supported: prompt templates are not stored here"),
    ("conversation", "is not supported; use `previous_response_id`"),
    ("context_management", "is not supported"),
    ("max_tool_calls", "is not supported: only function tools exist here, run by the caller"),
    ("vllm_xargs", "is not supported"),
)
# Chat field names the chat preparer may put in an error, and what the client called them.
_FIELDS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
)
_MESSAGES = re.compile(r"messages(?:\[(\d+)\])?")


@dataclass(frozen=True, slots=True)
class ResponsesTurn:
    """One Responses request as a chat request, and the conversation it leaves behind."""

    chat: ChatCompletionRequest
    # Earlier turns plus this turn's input, without ``instructions`` (which, as OpenAI
    # defines them, do not carry over to a follow-up).
    conversation: tuple[Message, ...]
    # For each chat message, the request field it came from (for error messages).
    sources: tuple[str, ...]


def refuse_unsupported(req: ResponsesRequest) -> None:
    for name, why in _REFUSED:
        value = getattr(req, name)
        if value is not None and value is not False:
            raise unsupported(name, why)
    if req.include:
        raise unsupported("include", "is not supported: no extra output data is offered")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "is not supported on /v1/responses")
    if req.truncation == "auto":
        raise unsupported("truncation", "supports only 'disabled'")
    if req.text is not None and req.text.verbosity is not None:
        raise unsupported("text.verbosity", "is not supported")
    reasoning = req.reasoning
    if reasoning is not None:
        for name in ("summary", "generate_summary"):
            if getattr(reasoning, name) is not None:
                raise unsupported(
                    f"reasoning.{name}", "is not supported: reasoning is returned whole"
                )
    if req.stream_options is not None and not req.stream:
        raise invalid(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
        )


def input_items(
    value: str | list[dict[str, Any]], *, ignore_unknown: bool = True
) -> list[InputItem]:
    """``input`` as typed items; a message item may leave out its ``type``. Fields no item
    type knows are dropped (:mod:`rankgate.app.schemas.unknown_fields`) unless ``ignore_unknown`` is
    off."""
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    if not value:
        raise invalid("'input' must not be an empty list", "input")
    items: list[InputItem] = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message")
        item_type = INPUT_ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if item_type is None:
            raise unsupported(
                f"input[{i}].type",
                f"'{kind}' is not supported; input items may be " + ", ".join(INPUT_ITEM_TYPES),
            )
        try:
            try:
                items.append(msgspec.convert(raw, item_type))
            except msgspec.ValidationError as exc:
                if not ignore_unknown or unknown_field(exc) is None:
                    raise
                items.append(convert_ignoring_unknown(raw, item_type, exc, "input"))
        except msgspec.ValidationError as exc:
            text = str(exc).replace("`$", f"`$.input[{i}]", 1)
            if "`$" not in str(exc):
                text = f"{text} - at `$.input[{i}]`"
            raise from_decode_error(msgspec.ValidationError(text)) from None
    return items


class _Conversation:
    """Chat messages built from input items, an assistant turn's items merged into one."""

    def __init__(self, history: Sequence[Message]) -> None:
        self.messages: list[Message] = list(history)
        self.sources: list[str] = ["previous_response_id"] * len(history)
        self.call_ids: set[str] = {
            call.id
            for message in history
            if isinstance(message, AssistantMessage)
            for call in message.tool_calls or ()
        }

    def add(self, item: InputItem, where: str) -> None:
        if isinstance(item, MessageItem):
            self._message(item, where)
        elif isinstance(item, FunctionCallItem):
            self._call(item, where)
        elif isinstance(item, FunctionCallOutputItem):
            self._call_output(item, where)
        else:
            self._reasoning(item, where)

    def _append(self, message: Message, where: str) -> None:
        self.messages.append(message)
        self.sources.append(where)

    def _assistant(self, where: str) -> AssistantMessage:
        """The assistant message an assistant item joins: the last message when it is one."""
        last = self.messages[-1] if self.messages else None
        if isinstance(last, AssistantMessage) and self.sources[-1] != "previous_response_id":
            return last
        message = AssistantMessage()
        self._append(message, where)
        return message

    def _message(self, item: MessageItem, where: str) -> None:
        content = item.content
        if item.role == "assistant":
            text = content if isinstance(content, str) else _assistant_text(content, where)
            message = self._assistant(where)
            if message.content is not None or message.tool_calls:
                message = AssistantMessage()
                self._append(message, where)
            message.content = text
            return
        if item.role in ("system", "developer"):
            parts = content if isinstance(content, str) else _text_parts(content, where)
            kind = SystemMessage if item.role == "system" else DeveloperMessage
            self._append(kind(content=parts), where)
            return
        if isinstance(content, str):
            self._append(UserMessage(content=content), where)
            return
        self._append(UserMessage(content=_user_parts(content, where)), where)

    def _call(self, item: FunctionCallItem, where: str) -> None:
        try:
            orjson.loads(item.arguments)
        except orjson.JSONDecodeError:
            raise invalid(f"'{where}.arguments' must be JSON text", f"{where}.arguments") from None
        message = self._assistant(where)
        call = ToolCall(
            id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
        )
        message.tool_calls = [*(message.tool_calls or ()), call]
        self.call_ids.add(item.call_id)

    def _call_output(self, item: FunctionCallOutputItem, where: str) -> None:
        if item.call_id not in self.call_ids:
            raise invalid(
                f"No tool call found for function call output with call_id {item.call_id}.",
                f"{where}.call_id",
            )
        output = item.output
        content: str | list[TextPart] = (
            output if isinstance(output, str) else [TextPart(text=p.text) for p in output]
        )
        self._append(ToolMessage(content=content, tool_call_id=item.call_id), where)

    def _reasoning(self, item: ReasoningItem, where: str) -> None:
        if item.encrypted_content is not None:
            raise unsupported(f"{where}.encrypted_content", "is not supported")
        parts = item.content if item.content else item.summary
        text = "\n".join(p.text for p in parts)
        message = self._assistant(where)
        if message.reasoning_content is not None or message.content is not None:
            message = AssistantMessage()
            self._append(message, where)
        message.reasoning_content = text


def _assistant_text(parts: list[Any], where: str) -> str:
    texts: list[str] = []
    for j, part in enumerate(parts):
        if isinstance(part, OutputText | InputText):
            texts.append(part.text)
        elif isinstance(part, Refusal):
            texts.append(part.refusal)
        else:
            raise invalid("an assistant message holds text only", f"{where}.content[{j}]")
    return "".join(texts)


def _text_parts(parts: list[Any], where: str) -> list[TextPart]:
    out: list[TextPart] = []
    for j, part in enumerate(parts):
        if not isinstance(part, InputText):
            raise invalid(
                "system and developer messages hold input_text parts only",
                f"{where}.content[{j}]",
            )
        out.append(TextPart(text=part.text))
    return out


def _user_parts(parts: list[Any], where: str) -> list[UserPart]:
    out: list[UserPart] = []
    for j, part in enumerate(parts):
        if isinstance(part, InputText):
            out.append(TextPart(text=part.text))
        elif isinstance(part, InputImage):
            if part.image_url is None:
                param = f"{where}.content[{j}].file_id"
                if part.file_id is None:
                    raise invalid("an input_image part needs 'image_url'", param)
                raise unsupported(param, "is not supported: send the image as image_url")
            detail = part.detail if part.detail in ("low", "high", "auto") else None
            out.append(ImageUrlPart(image_url=ImageUrl(url=part.image_url, detail=detail)))
        elif isinstance(part, InputAudioContent):
            audio = InputAudio(data=part.input_audio.data, format=part.input_audio.format)
            out.append(InputAudioPart(input_audio=audio))
        else:
            raise invalid(
                "a user message holds input_text, input_image and input_audio parts only",
                f"{where}.content[{j}]",
            )
    return out


def chat_request(
    req: ResponsesRequest, history: Sequence[Message], *, ignore_unknown: bool = True
) -> ResponsesTurn:
    """The chat request ``req`` stands for, after the stored ``history`` it follows."""
    refuse_unsupported(req)
    conversation = _Conversation(history)
    for i, item in enumerate(input_items(req.input, ignore_unknown=ignore_unknown)):
        conversation.add(item, "input" if isinstance(req.input, str) else f"input[{i}]")
    messages = conversation.messages
    sources = conversation.sources
    if req.instructions:
        messages = [SystemMessage(content=req.instructions), *messages]
        sources = ["instructions", *sources]
    tool_choice: Any = req.tool_choice
    if isinstance(tool_choice, ToolChoiceFunction):
        tool_choice = NamedToolChoice(function=NamedFunction(name=tool_choice.name))
    tools = _chat_tools(req)
    fmt = _response_format(req)
    logit_bias = _logit_bias(req)
    effort = req.reasoning.effort if req.reasoning is not None else None
    chat = ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=logit_bias,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        response_format=fmt,
        structured_outputs=req.structured_outputs,
        cache_salt=req.cache_salt,
        priority=req.priority,
        user=req.user,
        stream=req.stream,
        request_id=req.request_id,
        data_parallel_rank=req.data_parallel_rank,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=cast(Any, effort),
    )
    return ResponsesTurn(
        chat=chat,
        conversation=tuple(conversation.messages),
        sources=tuple(sources),
    )


def _chat_tools(req: ResponsesRequest) -> list[Tool] | None:
    """The Responses API's flat function tools as chat's nested ones."""
    if req.tools is None:
        return None
    return [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=t.name,
                description=t.description,
                parameters=t.parameters,
                strict=t.strict,
            ),
        )
        for t in req.tools
    ]


def _response_format(
    req: ResponsesRequest,
) -> ResponseFormatJsonObject | ResponseFormatJsonSchema | None:
    """``text.format`` as chat's ``response_format``; None for plain text."""
    text_format = req.text.format if req.text is not None else None
    if isinstance(text_format, FormatJsonObject):
        return ResponseFormatJsonObject()
    if isinstance(text_format, FormatJsonSchema):
        return ResponseFormatJsonSchema(
            json_schema=JsonSchemaSpec(
                name=text_format.name,
                description=text_format.description,
                schema=text_format.schema,
                strict=text_format.strict,
            )
        )
    return None


def _logit_bias(req: ResponsesRequest) -> dict[int, float] | None:
    """The bias map keyed by token id: JSON keys are strings, chat's schema wants ints."""
    if not req.logit_bias:
        return None
    logit_bias = {}
    for key, bias in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid("'logit_bias' keys must be token ids", "logit_bias")
        logit_bias[int(key)] = bias
    return logit_bias


def renamed(error: ApiError, turn: ResponsesTurn) -> ApiError:
    """``error`` with the chat fields it names replaced by the Responses fields they came
    from (``messages[3]`` → the input item that became message 3)."""

    def source(match: re.Match[str]) -> str:
        index = match.group(1)
        if index is None:
            return "input"
        k = int(index)
        return turn.sources[k] if k < len(turn.sources) else "input"

    def rename(text: str) -> str:
        text = _MESSAGES.sub(source, text)
        for chat_name, name in _FIELDS:
            text = text.replace(chat_name, name)
        return text

    param = rename(error.param) if error.param is not None else None
    return ApiError(
        error.status,
        rename(error.message),
        type=error.type,
        param=param,
        code=error.code,
        retry_after=error.retry_after,
    )
