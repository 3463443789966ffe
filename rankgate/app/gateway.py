"""The per-process serving state the routes share, built once the engine is discovered.

Routes depend on the :class:`Engine` protocol rather than on the sidecar class, so the whole
HTTP surface can be driven in tests by any engine that speaks the same typed contract.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rankgate.app.edge.limits import InputLimits
from rankgate.app.parsers import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSERS,
    canonical_reasoning_parser,
    canonical_tool_parser,
    vocabulary,
)
from rankgate.app.prepare.chat import ChatPreparer, ChatSettings
from rankgate.app.prepare.completion import CompletionPreparer
from rankgate.app.prepare.media import (
    AUDIO_PLACEHOLDERS,
    IMAGE_PLACEHOLDERS,
    VIDEO_PLACEHOLDERS,
    MediaHook,
)
from rankgate.app.prepare.models import ModelRegistry
from rankgate.app.prepare.template import ChatTemplate
from rankgate.app.tokens.tokenizer import TextTokenizer, locate_tokenizer
from rankgate.sidecar import Admission, Delta, EngineInfo, PreparedRequest

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What the routes and the server need of the engine: the sidecar, the prefill/decode
    pair, or a test's double."""

    @property
    def ready(self) -> bool: ...

    @property
    def info(self) -> EngineInfo: ...

    @property
    def admission(self) -> Admission | None:
        """The per-rank admission whose state ``/metrics`` reports (None: no admission)."""

    def generate(self, request: PreparedRequest) -> AsyncIterator[Delta]: ...

    def generate_batch(self, requests: Sequence[PreparedRequest], n: int) -> AsyncIterator[Delta]:
        """Several prompts of one completions request: request k's choice i as choice
        ``k * n + i``, admitted as one where the engine can."""

    async def list_loras(self) -> tuple[str, ...]: ...

    async def close(self) -> None:
        """Stop serving: queued requests are refused and open streams end with an error."""


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """Operator choices that shape serving (CLI flags), all optional."""

    tokenizer: str | None = None
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # The model's image placeholder token id, when the tokenizer's own cannot be found.
    image_token_id: int | None = None
    # Shape limits for JSON that clients embed in strings (tool-call arguments, schemas).
    limits: InputLimits = field(default_factory=InputLimits)


class Gateway:
    def __init__(
        self,
        engine: Engine,
        options: ServingOptions,
        media: MediaHook | None = None,
    ) -> None:
        info = engine.info
        self.engine = engine
        directory = locate_tokenizer(options.tokenizer, info.model_id)
        self.tokenizer = TextTokenizer(directory)
        source = self.tokenizer.files.chat_template
        if options.chat_template is not None:
            source = Path(options.chat_template).read_text()
        self.template = (
            ChatTemplate(source, self.tokenizer.files.special_tokens) if source else None
        )
        if self.template is None:
            log.warning("no chat template in %s: /v1/chat/completions will refuse", directory)

        def known(candidates: tuple[str, ...]) -> str | None:
            return next((p for p in candidates if self.tokenizer.token_id(p) is not None), None)

        settings = ChatSettings(
            tool_call_parser=_parser(options.tool_call_parser, info.tool_call_parser, "tool call"),
            reasoning_parser=_parser(options.reasoning_parser, info.reasoning_parser, "reasoning"),
            image_placeholder=known(IMAGE_PLACEHOLDERS),
            supports_images=info.supports_multimodal,
            image_token_id=options.image_token_id,
            audio_placeholder=known(AUDIO_PLACEHOLDERS),
            video_placeholder=known(VIDEO_PLACEHOLDERS),
            vocabulary=vocabulary(directory),
        )
        self.settings = settings
        self.models = ModelRegistry(
            info.served_model_name,
            info.aliases,
            info.model_id,
            engine.list_loras if info.supports_lora else None,
        )
        if media is not None:
            media.configure(info)
        self.chat = ChatPreparer(self.tokenizer, self.template, settings, media, options.limits)
        self.completions = CompletionPreparer(self.tokenizer, options.limits)
        log.info(
            "tokenizer %s; chat template %s; tool-call parser %s; reasoning parser %s",
            directory,
            "none" if self.template is None else self.template.content_format,
            settings.tool_call_parser or "none",
            settings.reasoning_parser or "none",
        )


def _parser(operator: str | None, engine: str, what: str) -> str | None:
    """The operator's choice wins; vLLM's is used when this gateway knows it."""
    tool = what == "tool call"
    canonical = canonical_tool_parser if tool else canonical_reasoning_parser
    known = TOOL_CALL_PARSERS if tool else REASONING_PARSER_NAMES
    if operator:
        name = canonical(operator)
        if name is None:
            raise ValueError(f"unknown {what} parser {operator!r}; known: {', '.join(known)}")
        return name
    if not engine:
        return None
    name = canonical(engine)
    if name is None:
        log.warning(
            "vLLM names %s parser %r, which this gateway does not implement; output is returned "
            "as plain text (known: %s)",
            what,
            engine,
            ", ".join(known),
        )
    return name
