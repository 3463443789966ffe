"""OpenAI chat requests → rendered, tokenized :class:`PreparedRequest` plus the output plan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from app.errors import ApiError, invalid, unsupported
from app.prepare.media import MediaHook
from app.prepare.params import (
    refuse_unsupported,
    sampling_params,
    stopping_params,
    structured_output,
)
from app.prepare.prompt_cache import PromptCache
from app.prepare.rank import resolve_rank
from app.prepare.template import ChatTemplate, ContentFormat, TemplateRenderError
from app.prepare.tokenizer import TextTokenizer
from app.respond.parsers import OutputPlan, required_tools_schema
from app.respond.parsers.reasoning import PARSERS as REASONING_STARTS_INSIDE
from app.schemas.requests import (
    AssistantMessage,
    ChatCompletionRequest,
    DeveloperMessage,
    ImageUrlPart,
    Message,
    NamedToolChoice,
    RefusalPart,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserMessage,
)
from multimodal.errors import ImageError
from multimodal.types import ImageRef
from sidecar.types import Delta, MediaInput, OutputOptions, PreparedRequest, StructuredOutput

# Conversations longer than this (characters) are rendered and tokenized off the event loop.
OFFLOAD_CHARS = 16_384
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_CHAT_REFUSED = (
    ("functions", "is deprecated and not supported; use `tools`"),
    ("function_call", "is deprecated and not supported; use `tool_choice`"),
    ("audio", "is not supported: this gateway outputs text only"),
    ("prediction", "is not supported"),
    ("web_search_options", "is not supported"),
    ("chat_template", "is not accepted per request; the operator sets the template"),
    ("echo", "is not supported for chat completions"),
    ("verbosity", "is not supported"),
)


@dataclass(frozen=True, slots=True)
class ChatSettings:
    tool_call_parser: str | None
    reasoning_parser: str | None
    image_placeholder: str | None
    # Whether the engine advertises ``supports_multimodal``; image parts are refused if not.
    supports_images: bool = True
    # The placeholder's token id when the operator names it (``--image-token-id``); else the
    # tokenizer's id for ``image_placeholder``.
    image_token_id: int | None = None


@dataclass(frozen=True, slots=True)
class PreparedChat:
    request: PreparedRequest
    plan: OutputPlan
    prompt_len: int
    top_logprobs: int | None


def _text_of(content: str | list[Any], sep: str = "\n") -> str:
    if isinstance(content, str):
        return content
    return sep.join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


class _Converter:
    """Messages as the dicts a chat template reads, collecting image parts on the way."""

    def __init__(self, fmt: ContentFormat, placeholder: str | None) -> None:
        self.fmt = fmt
        self.placeholder = placeholder
        self.images: list[ImageRef] = []

    def content(self, content: str | list[Any] | None, where: str) -> Any:
        if content is None:
            return [] if self.fmt == "openai" else ""
        if isinstance(content, str):
            return [{"type": "text", "text": content}] if self.fmt == "openai" else content
        parts: list[dict[str, Any]] = []
        texts: list[str] = []
        images = 0
        for j, part in enumerate(content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                texts.append(part.text)
            elif isinstance(part, RefusalPart):
                parts.append({"type": "text", "text": part.refusal})
                texts.append(part.refusal)
            elif isinstance(part, ImageUrlPart):
                self.images.append(
                    ImageRef(url=part.image_url.url, uuid=part.uuid, detail=part.image_url.detail)
                )
                parts.append({"type": "image"})
                images += 1
                if self.fmt == "string" and self.placeholder is None:
                    raise invalid(
                        "this model's chat template has no image placeholder; images are not "
                        "supported",
                        f"{where}.content[{j}]",
                    )
        if self.fmt == "openai":
            return parts
        text = "\n".join(texts)
        if images:
            assert self.placeholder is not None
            text = "\n".join([self.placeholder] * images + ([text] if text else []))
        return text

    def message(self, message: Message, i: int) -> dict[str, Any]:
        where = f"messages[{i}]"
        if isinstance(message, SystemMessage | DeveloperMessage):
            out: dict[str, Any] = {
                "role": "system",
                "content": self.content(message.content, where),
            }
        elif isinstance(message, UserMessage):
            out = {"role": "user", "content": self.content(message.content, where)}
        elif isinstance(message, ToolMessage):
            out = {
                "role": "tool",
                "content": self.content(message.content, where),
                "tool_call_id": message.tool_call_id,
            }
        else:
            out = self._assistant(message, where)
        name = getattr(message, "name", None)
        if name is not None:
            out["name"] = name
        return out

    def _assistant(self, message: AssistantMessage, where: str) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content(message.content, where)}
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                try:
                    arguments = orjson.loads(call.function.arguments)
                except orjson.JSONDecodeError:
                    raise invalid(
                        f"'{where}.tool_calls[{j}].function.arguments' must be JSON text",
                        f"{where}.tool_calls[{j}].function.arguments",
                    ) from None
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            out["tool_calls"] = calls
        reasoning = message.reasoning_content or message.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if message.refusal is not None and message.content is None:
            out["content"] = self.content(message.refusal, where)
        return out


class ChatPreparer:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        template: ChatTemplate | None,
        settings: ChatSettings,
        media: MediaHook | None,
        ranks: tuple[int, ...] = (),
    ) -> None:
        self._tok = tokenizer
        self._ranks = ranks
        self._template = template
        self._settings = settings
        self._media = media
        self._prompts = PromptCache()
        self._image_token = settings.image_token_id
        if self._image_token is None and settings.image_placeholder:
            self._image_token = tokenizer.token_id(settings.image_placeholder)

    async def prepare(
        self,
        req: ChatCompletionRequest,
        *,
        request_id: str,
        lora_name: str | None,
        max_model_len: int,
        rank: int | None,
    ) -> PreparedChat:
        refuse_unsupported(req, _CHAT_REFUSED)
        rank = resolve_rank(req.data_parallel_rank, rank, self._ranks)
        template = self._template
        if template is None:
            raise ApiError(
                400,
                "this model has no chat template; the operator must set one with "
                "--chat-template, or use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        if req.modalities is not None and req.modalities != ["text"]:
            raise unsupported("modalities", 'supports only ["text"]')
        plan, forced = self._plan(req)
        structured = structured_output(req)
        if forced is not None:
            if structured is not None:
                raise invalid(
                    "tool_choice 'required' or a named function cannot be combined with "
                    "another structured-output constraint",
                    "tool_choice",
                )
            structured = forced
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")

        converter = _Converter(template.content_format, self._settings.image_placeholder)
        messages = [converter.message(m, i) for i, m in enumerate(req.messages)]
        if converter.images and self._media is None:
            raise unsupported(
                "messages", "contains image parts, which this gateway cannot serve yet"
            )
        if converter.images and not self._settings.supports_images:
            raise ApiError(
                400,
                f"`messages` contains images, but the model `{req.model}` does not support "
                "image input.",
                param="messages",
                code="model_not_multimodal",
            )
        extra = dict(req.chat_template_kwargs or {})
        clash = _RESERVED_KWARGS.intersection(extra)
        if clash:
            raise invalid(
                f"'chat_template_kwargs' must not set {sorted(clash)}", "chat_template_kwargs"
            )
        if req.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", req.reasoning_effort)
        tools = [_tool_dict(t) for t in req.tools] if req.tools else None
        add_special = bool(req.add_special_tokens)
        generation_prompt = req.add_generation_prompt and not req.continue_final_message
        size = sum(len(str(m.get("content", ""))) for m in messages)
        key = None
        if size <= OFFLOAD_CHARS and template.deterministic:
            key = _conversation_key(
                messages,
                tools,
                req.documents,
                generation_prompt,
                req.continue_final_message,
                extra,
                add_special,
            )
        cached = self._prompts.get(key) if key is not None else None

        def render() -> tuple[int, ...]:
            text = template.render(
                messages,
                tools=tools,
                documents=req.documents,
                add_generation_prompt=generation_prompt,
                continue_final_message=req.continue_final_message,
                extra=extra,
            )
            return tuple(self._tok.encode(text, add_special))

        if cached is not None:
            ids = cached
        else:
            try:
                ids = await asyncio.to_thread(render) if size > OFFLOAD_CHARS else render()
            except TemplateRenderError as exc:
                raise invalid(f"chat template error: {exc}", "messages") from None
            if key is not None:
                self._prompts.put(key, ids)
        if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
            ids = ids[-req.truncate_prompt_tokens :]

        media: tuple[MediaInput, ...] = ()
        if converter.images:
            assert self._media is not None
            positions: list[int] | None = None
            image_token = self._image_token
            if image_token is not None:
                positions = [i for i, token in enumerate(ids) if token == image_token]
                if len(positions) != len(converter.images):
                    raise invalid(
                        f"the rendered prompt has {len(positions)} image placeholders for "
                        f"{len(converter.images)} images",
                        "messages",
                    )
            try:
                media = await self._media.prepare(converter.images)
            except ImageError as exc:
                raise ApiError(
                    exc.status, exc.message, param="messages", code="invalid_image"
                ) from None
            if positions is not None:
                # Where each image sits lets the router expand it and match the blocks it fills.
                media = tuple(
                    msgspec.structs.replace(item, position=position)
                    for item, position in zip(media, positions, strict=True)
                )

        max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        stopping = stopping_params(
            req,
            prompt_len=len(ids),
            requested=req.max_completion_tokens or req.max_tokens,
            max_model_len=max_model_len,
            vocab_size=self._tok.vocab_size,
            prompt_param="messages",
            max_param=max_param,
        )
        top = (req.top_logprobs or 0) if req.logprobs else None
        skip_special = req.skip_special_tokens and not plan.tool_calls
        prepared = PreparedRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=sampling_params(req, self._tok.vocab_size),
            stopping=stopping,
            output=OutputOptions(logprobs=top, skip_special_tokens=skip_special),
            structured=structured,
            n=req.n,
            cache_salt=req.cache_salt,
            priority=req.priority,
            lora_name=lora_name,
            media=media,
            kv_transfer_params=req.kv_transfer_params,
            rank=rank,
            stream=req.stream,
        )
        return PreparedChat(request=prepared, plan=plan, prompt_len=len(ids), top_logprobs=top)

    def observe(self, prepared: PreparedChat, first: Delta | None) -> None:
        """Report vLLM's expanded prompt length of an image request to the media hook."""
        media = prepared.request.media
        if media and self._media is not None and first is not None and first.prompt_tokens:
            self._media.observe(media, prepared.prompt_len, first.prompt_tokens)

    def _plan(self, req: ChatCompletionRequest) -> tuple[OutputPlan, StructuredOutput | None]:
        settings = self._settings
        starts_inside = (
            REASONING_STARTS_INSIDE[settings.reasoning_parser]
            if settings.reasoning_parser is not None
            else None
        )
        choice = req.tool_choice
        if choice is not None and choice != "none" and not req.tools:
            raise invalid("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            assert req.tools is not None
            match = next((t for t in req.tools if t.function.name == choice.function.name), None)
            if match is None:
                raise invalid(
                    f"tool_choice names function '{choice.function.name}', which is not in 'tools'",
                    "tool_choice.function.name",
                )
            schema = match.function.parameters or {"type": "object"}
            forced = StructuredOutput(kind="json", spec=orjson.dumps(schema).decode())
            plan = OutputPlan(
                reasoning_starts_inside=starts_inside, forced_name=match.function.name
            )
            return plan, forced
        if choice == "required":
            assert req.tools is not None
            schema = required_tools_schema(
                [(t.function.name, t.function.parameters) for t in req.tools]
            )
            forced = StructuredOutput(kind="json", spec=orjson.dumps(schema).decode())
            return OutputPlan(reasoning_starts_inside=starts_inside, forced_any=True), forced
        parse_tools = bool(req.tools) and choice != "none" and settings.tool_call_parser is not None
        return OutputPlan(reasoning_starts_inside=starts_inside, tool_calls=parse_tools), None


def _conversation_key(*parts: Any) -> bytes | None:
    """Everything a render reads besides the template, as canonical bytes (None when some
    part is not plain JSON, which is then rendered each time)."""
    try:
        return orjson.dumps(parts)
    except TypeError:
        return None


def _tool_dict(tool: Any) -> dict[str, Any]:
    value: dict[str, Any] = msgspec.to_builtins(tool)
    return value
