"""OpenAI chat requests → rendered, tokenized :class:`PreparedRequest` plus the output plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from rankgate.app.edge.limits import InputLimits, check_engine_json, check_fanout, check_json_text
from rankgate.app.errors import ApiError, invalid, media_refused, unsupported
from rankgate.app.parsers import OutputPlan, Tool, Vocabulary, plan_for
from rankgate.app.prepare.media import MediaHook
from rankgate.app.prepare.params import (
    check_context,
    prompt_logprobs_of,
    refuse_unfitting_text,
    refuse_unsupported,
    sampling_params,
    stopping_params,
    structured_output,
)
from rankgate.app.prepare.prompt_cache import PromptCache
from rankgate.app.prepare.rank import resolve_rank
from rankgate.app.prepare.template import ChatTemplate, ContentFormat, TemplateRenderError
from rankgate.app.schemas.requests import (
    AssistantMessage,
    AudioUrlPart,
    ChatCompletionRequest,
    DeveloperMessage,
    ImageUrlPart,
    InputAudioPart,
    Message,
    NamedToolChoice,
    RefusalPart,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserMessage,
    VideoUrlPart,
)
from rankgate.app.serving.offload import offload as offload_to
from rankgate.app.tokens.tokenizer import TextTokenizer
from rankgate.multimodal import MediaError, MediaKind, MediaOverBudget, MediaRef
from rankgate.sidecar import (
    Delta,
    MediaInput,
    OutputOptions,
    PreparedRequest,
    RequestTrace,
    StoppingParams,
    StructuredOutput,
)

# Requests with bodies larger than this (bytes, whichever fields hold them) are converted,
# rendered and tokenized off the event loop; only smaller ones are keyed for the prompt cache.
OFFLOAD_BYTES = 16_384
KEYED_BYTES = 1 << 20
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
    # Whether the engine advertises ``supports_multimodal``; media parts are refused if not.
    supports_images: bool = True
    # The placeholder's token id when the operator names it (``--image-token-id``); else the
    # tokenizer's id for ``image_placeholder``.
    image_token_id: int | None = None
    # The tokens that stand for one audio clip and one video in the prompt, when the
    # tokenizer has them (their ids are the tokenizer's).
    audio_placeholder: str | None = None
    video_placeholder: str | None = None
    # The tokenizer's markers and special tokens, as the output parsers need them.
    vocabulary: Vocabulary = field(default_factory=Vocabulary)


class PreparedChat(msgspec.Struct, frozen=True, kw_only=True):
    """A Struct for the reason :class:`rankgate.app.respond.context.ResponseContext` is one."""

    request: PreparedRequest
    plan: OutputPlan
    prompt_len: int
    top_logprobs: int | None
    prompt_logprobs: int | None = None
    # The client's max_tokens / max_completion_tokens, and the context it was checked against.
    # While an image's expanded size is unknown the check used one token for it; the engine's
    # expanded count finishes the check (:meth:`ChatPreparer.observe`).
    requested: int | None = None
    max_model_len: int = 0
    counts_known: bool = True


def _text_of(content: str | list[Any], sep: str = "\n") -> str:
    if isinstance(content, str):
        return content
    return sep.join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


_NOUNS: dict[MediaKind, str] = {"image": "images", "audio": "audio", "video": "video"}


def _media_part(part: Any) -> MediaRef | None:
    """The media reference an image, audio or video content part stands for."""
    if isinstance(part, ImageUrlPart):
        return MediaRef(url=part.image_url.url, uuid=part.uuid, detail=part.image_url.detail)
    if isinstance(part, InputAudioPart):
        audio = part.input_audio
        url = f"data:audio/{audio.format.lower()};base64,{audio.data}"
        return MediaRef(url=url, uuid=part.uuid, kind="audio")
    if isinstance(part, AudioUrlPart):
        return MediaRef(url=part.audio_url.url, uuid=part.uuid, kind="audio")
    if isinstance(part, VideoUrlPart):
        return MediaRef(url=part.video_url.url, uuid=part.uuid, kind="video")
    return None


class _Converter:
    """Messages as the dicts a chat template reads, collecting media parts on the way."""

    def __init__(
        self,
        fmt: ContentFormat,
        placeholders: dict[MediaKind, str | None],
        limits: InputLimits,
    ) -> None:
        self.fmt = fmt
        self.placeholders = placeholders
        self.limits = limits
        self.media: list[MediaRef] = []

    def content(self, content: str | list[Any] | None, where: str) -> Any:
        if content is None:
            return [] if self.fmt == "openai" else ""
        if isinstance(content, str):
            return [{"type": "text", "text": content}] if self.fmt == "openai" else content
        parts: list[dict[str, Any]] = []
        texts: list[str] = []
        marks: list[str] = []
        for j, part in enumerate(content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                texts.append(part.text)
            elif isinstance(part, RefusalPart):
                parts.append({"type": "text", "text": part.refusal})
                texts.append(part.refusal)
            else:
                ref = _media_part(part)
                assert ref is not None
                self.media.append(ref)
                parts.append({"type": ref.kind})
                if self.fmt == "string":
                    placeholder = self.placeholders.get(ref.kind)
                    if placeholder is None:
                        raise invalid(
                            f"this model's chat template has no {ref.kind} placeholder; "
                            f"{_NOUNS[ref.kind]} are not supported",
                            f"{where}.content[{j}]",
                        )
                    marks.append(placeholder)
        if self.fmt == "openai":
            return parts
        text = "\n".join(texts)
        if marks:
            text = "\n".join(marks + ([text] if text else []))
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
                param = f"{where}.tool_calls[{j}].function.arguments"
                check_json_text(call.function.arguments, param, self.limits)
                try:
                    arguments = orjson.loads(call.function.arguments)
                except orjson.JSONDecodeError:
                    raise invalid(f"'{param}' must be JSON text", param) from None
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
        limits: InputLimits | None = None,
    ) -> None:
        self._tok = tokenizer
        self._limits = limits or InputLimits()
        self._template = template
        self._settings = settings
        self._media = media
        self._prompts = PromptCache()
        image_token = settings.image_token_id
        if image_token is None and settings.image_placeholder:
            image_token = tokenizer.token_id(settings.image_placeholder)
        self._placeholders: dict[MediaKind, str | None] = {
            "image": settings.image_placeholder,
            "audio": settings.audio_placeholder,
            "video": settings.video_placeholder,
        }
        self._media_tokens: dict[MediaKind, int | None] = {
            "image": image_token,
            "audio": tokenizer.token_id(settings.audio_placeholder)
            if settings.audio_placeholder
            else None,
            "video": tokenizer.token_id(settings.video_placeholder)
            if settings.video_placeholder
            else None,
        }

    async def prepare(
        self,
        req: ChatCompletionRequest,
        *,
        request_id: str,
        lora_name: str | None,
        max_model_len: int,
        rank: int | None,
        trace: RequestTrace | None = None,
        body_size: int = 0,
        affinity: str | None = None,
    ) -> PreparedChat:
        """The engine request for ``req``, in the steps vLLM takes: check the fields, settle
        which constraint shapes the output, render and tokenize, fit the images into the
        context, check the context, assemble.

        ``body_size`` (bytes of the request body) decides whether the work is done off the
        event loop: every field counts, not only the message texts."""
        rank = self._check_fields(req, rank)
        template = self._require_template()
        plan, structured = self._constraint(req)
        ids, refs = await self._render(req, template, body_size, max_model_len)
        media = await self._fit_media(req, ids, refs, max_model_len) if refs else ()
        requested = req.max_completion_tokens or req.max_tokens
        # vLLM checks the context against the prompt with each image expanded.
        expanded_len = len(ids) + sum((item.num_tokens or 1) - 1 for item in media)
        stopping = self._stopping(req, expanded_len, max_model_len)
        counts_known = all(item.num_tokens is not None for item in media)
        top = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = prompt_logprobs_of(req)
        prepared = PreparedRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=sampling_params(req, self._tok.vocab_size),
            stopping=stopping,
            # vLLM's expanded prompt shows each new image's size run by run.
            output=OutputOptions(
                logprobs=top,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens and not plan.needs_special_tokens,
                prompt_token_ids=not counts_known and self._placed(media),
            ),
            structured=structured,
            n=req.n,
            cache_salt=req.cache_salt,
            priority=req.priority,
            lora_name=lora_name,
            media=media,
            kv_transfer_params=req.kv_transfer_params,
            rank=rank,
            affinity=affinity,
            stream=req.stream,
            trace=trace,
        )
        return PreparedChat(
            request=prepared,
            plan=plan,
            prompt_len=len(ids),
            top_logprobs=top,
            prompt_logprobs=prompt_logprobs,
            requested=requested,
            max_model_len=max_model_len,
            counts_known=counts_known,
        )

    def _check_fields(self, req: ChatCompletionRequest, rank: int | None) -> int | None:
        """Refuse what the request asks and this gateway cannot do, before any rendering;
        the rank pin the body and the header agree on."""
        refuse_unsupported(req, _CHAT_REFUSED)
        rank = resolve_rank(req.data_parallel_rank, rank)
        if req.modalities is not None and req.modalities != ["text"]:
            raise unsupported("modalities", 'supports only ["text"]')
        for name in ("media_io_kwargs", "mm_processor_kwargs"):
            if getattr(req, name):
                raise unsupported(
                    name,
                    "is not supported: vLLM's gRPC API takes no per-request media settings, so "
                    "the engine's own apply",
                )
        check_fanout(1, req.n, self._limits)
        if req.kv_transfer_params:
            check_engine_json(req.kv_transfer_params, "kv_transfer_params")
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        return rank

    def _constraint(self, req: ChatCompletionRequest) -> tuple[OutputPlan, StructuredOutput | None]:
        """The output plan and the one structured-output constraint the engine gets: the tool
        choice's, the request's own, or neither."""
        plan, forced = self._plan(req)
        structured = structured_output(req, self._limits)
        if forced is not None and structured is not None and not (plan.named or plan.required):
            # tool_choice auto with strict tools or no parallel calls: the request's own
            # constraint wins (vLLM would combine both; that needs xgrammar's grammar union).
            forced = None
        if forced is None:
            return plan, structured
        if structured is not None:
            raise invalid(
                "tool_choice 'required' or a named function cannot be combined with "
                "another structured-output constraint",
                "tool_choice",
            )
        return plan, forced

    async def _fit_media(
        self,
        req: ChatCompletionRequest,
        ids: tuple[int, ...],
        refs: list[MediaRef],
        max_model_len: int,
    ) -> tuple[MediaInput, ...]:
        """The media as engine inputs, each where it sits in the prompt (in prompt order),
        within what the context leaves them: the text around them and the tokens asked for
        (at least one) take the rest. Over that, vLLM's error for the prompt, counted before
        any item is decoded."""
        asked = req.max_completion_tokens or req.max_tokens or 1
        text_len = len(ids) - len(refs)
        try:
            media, positions = await self._media_inputs(ids, refs, max_model_len - text_len - asked)
        except MediaOverBudget as exc:
            self._stopping(req, text_len + exc.tokens, max_model_len)
            raise ApiError(
                400, exc.message, param="messages", code="context_length_exceeded"
            ) from None
        if positions is None:
            return media
        # Where each item sits lets the router expand it and match the blocks it fills.
        placed = sorted(zip(positions, media, strict=True), key=lambda pair: pair[0])
        return tuple(msgspec.structs.replace(item, position=where) for where, item in placed)

    def _placed(self, media: tuple[MediaInput, ...]) -> bool:
        """Whether the placeholder of every kind in ``media`` has a known token id."""
        return all(self._media_tokens[item.modality] is not None for item in media)

    def _stopping(
        self, req: ChatCompletionRequest, prompt_len: int, max_model_len: int
    ) -> StoppingParams:
        """The stopping parameters, or vLLM's 400 when a prompt of ``prompt_len`` tokens and
        the tokens asked for cannot fit the context."""
        return stopping_params(
            req,
            prompt_len=prompt_len,
            requested=req.max_completion_tokens or req.max_tokens,
            max_model_len=max_model_len,
            vocab_size=self._tok.vocab_size,
            prompt_param="messages",
            max_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        )

    async def tokenize(
        self, req: ChatCompletionRequest, body_size: int = 0, max_model_len: int | None = None
    ) -> tuple[int, ...]:
        """The prompt token ids ``req`` is sent to the engine with (``/tokenize``), each
        image placeholder expanded to the tokens the engine makes of that image; a text surely
        longer than ``max_model_len`` tokens is refused before it is tokenized."""
        template = self._require_template()
        ids, refs = await self._render(req, template, body_size, max_model_len)
        if not refs:
            return ids
        media, positions = await self._media_inputs(ids, refs)
        if positions is None or any(item.num_tokens is None for item in media):
            raise ApiError(
                400,
                "the number of tokens this model makes of these media is not known yet; "
                "send them once through /v1/chat/completions, or tokenize without them",
                param="messages",
                code="image_tokens_unknown",
            )
        expanded: list[int] = []
        last = 0
        for position, item in sorted(zip(positions, media, strict=True), key=lambda p: p[0]):
            assert item.num_tokens is not None
            expanded.extend(ids[last:position])
            expanded.extend([ids[position]] * item.num_tokens)
            last = position + 1
        expanded.extend(ids[last:])
        return tuple(expanded)

    def _require_template(self) -> ChatTemplate:
        if self._template is None:
            raise ApiError(
                400,
                "this model has no chat template; the operator must set one with "
                "--chat-template, or use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        return self._template

    async def _render(
        self,
        req: ChatCompletionRequest,
        template: ChatTemplate,
        body_size: int,
        max_model_len: int | None = None,
    ) -> tuple[tuple[int, ...], list[MediaRef]]:
        """The messages rendered with the template and tokenized, and their images; off the
        event loop when the body is large (``body_size`` bytes: every field counts). A text
        surely longer than ``max_model_len`` tokens is refused before it is tokenized."""
        offload = body_size > OFFLOAD_BYTES
        converter = _Converter(template.content_format, self._placeholders, self._limits)

        def convert() -> list[dict[str, Any]]:
            return [converter.message(m, i) for i, m in enumerate(req.messages)]

        messages = await offload_to(body_size, convert) if offload else convert()
        if converter.media:
            self._check_media_served(converter.media, req.model)
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
        key = None
        if body_size <= KEYED_BYTES and template.deterministic:
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
            if (
                max_model_len is not None
                and req.truncate_prompt_tokens is None
                and self._tok.surely_exceeds(text, max_model_len)
            ):
                raise refuse_unfitting_text(len(text), max_model_len, "messages")
            return tuple(self._tok.encode(text, add_special))

        if cached is not None:
            ids = cached
        else:
            try:
                ids = await offload_to(body_size, render) if offload else render()
            except TemplateRenderError as exc:
                raise invalid(f"chat template error: {exc}", "messages") from None
            if key is not None:
                self._prompts.put(key, ids)
        if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
            ids = ids[-req.truncate_prompt_tokens :]
        return ids, converter.media

    def _check_media_served(self, refs: list[MediaRef], model: str) -> None:
        kinds = [kind for kind in _NOUNS if any(ref.kind == kind for ref in refs)]
        if self._media is None:
            raise unsupported(
                "messages",
                f"contains {' and '.join(_NOUNS[k] for k in kinds)} parts, which this gateway "
                "cannot serve yet",
            )
        if not self._settings.supports_images:
            raise ApiError(
                400,
                f"`messages` contains {' and '.join(_NOUNS[k] for k in kinds)}, but the model "
                f"`{model}` does not support {' or '.join(kinds)} input.",
                param="messages",
                code="model_not_multimodal",
            )

    async def _media_inputs(
        self, ids: tuple[int, ...], refs: list[MediaRef], budget: int | None = None
    ) -> tuple[tuple[MediaInput, ...], list[int] | None]:
        """The prepared media, in ``refs`` order, and where each placeholder sits in ``ids``
        (None when a placeholder's token id is unknown): the n-th item of a kind is the n-th
        placeholder of that kind."""
        assert self._media is not None
        at = [0] * len(refs)
        placed = True
        for kind in _NOUNS:
            members = [i for i, ref in enumerate(refs) if ref.kind == kind]
            if not members:
                continue
            token = self._media_tokens[kind]
            if token is None:
                placed = False
                break
            found = [i for i, t in enumerate(ids) if t == token]
            if len(found) != len(members):
                raise invalid(
                    f"the rendered prompt has {len(found)} {kind} placeholders for "
                    f"{len(members)} {_NOUNS[kind]}",
                    "messages",
                )
            for member, where in zip(members, found, strict=True):
                at[member] = where
        positions = at if placed else None
        try:
            media = await self._media.prepare(refs, budget)
        except MediaOverBudget:
            raise
        except MediaError as exc:
            raise media_refused(exc.status, exc.message, exc.label.partition(" ")[0]) from None
        return media, positions

    def observe(self, prepared: PreparedChat, first: Delta | None) -> None:
        """Report vLLM's expanded prompt of an image request to the media hook, and finish the
        context-length check an image of unknown size left open.

        Raises ApiError (400, as vLLM's own server answers) when the expanded prompt and the
        requested tokens do not fit the context; the caller closes the engine stream.
        """
        media = prepared.request.media
        if not media or self._media is None or first is None or not first.prompt_tokens:
            return
        self._media.observe(
            media,
            prepared.prompt_len,
            first.prompt_tokens,
            first.prompt_token_ids,
            prepared.request.prompt_token_ids,
        )
        requested, limit = prepared.requested, prepared.max_model_len
        if not prepared.counts_known and requested is not None:
            check_context(first.prompt_tokens, requested, limit)

    def _plan(self, req: ChatCompletionRequest) -> tuple[OutputPlan, StructuredOutput | None]:
        settings = self._settings
        choice = req.tool_choice
        if choice is not None and choice != "none" and not req.tools:
            raise invalid("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        named: str | None = None
        if isinstance(choice, NamedToolChoice):
            assert req.tools is not None
            named = choice.function.name
            if not any(t.function.name == named for t in req.tools):
                raise invalid(
                    f"tool_choice names function '{named}', which is not in 'tools'",
                    "tool_choice.function.name",
                )
        tools = (
            [
                Tool(t.function.name, t.function.parameters, t.function.strict is True)
                for t in req.tools
            ]
            if req.tools
            else None
        )
        try:
            result = plan_for(
                settings.tool_call_parser,
                settings.reasoning_parser,
                settings.vocabulary,
                tools=tools,
                tool_choice=None if named is not None else choice,  # type: ignore[arg-type]
                named=named,
                parallel_tool_calls=req.parallel_tool_calls,
                template_kwargs=req.chat_template_kwargs or {},
            )
        except ValueError as exc:
            raise invalid(str(exc), "tools") from None
        forced = None
        if result.schema is not None:
            forced = StructuredOutput(kind="json", spec=orjson.dumps(result.schema).decode())
        elif result.structural_tag is not None:
            spec = orjson.dumps(result.structural_tag).decode()
            forced = StructuredOutput(kind="structural_tag", spec=spec)
        return result.plan, forced


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
