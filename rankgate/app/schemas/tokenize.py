"""``/tokenize`` and ``/detokenize`` bodies, in vLLM's shapes.

One request Struct takes both of vLLM's tokenize forms: ``prompt`` (as ``/v1/completions``
tokenizes it) or ``messages`` (as ``/v1/chat/completions`` renders and tokenizes them).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from rankgate.app.schemas.requests import Message, Tool

_STRICT = {"forbid_unknown_fields": True, "kw_only": True}


class TokenizeRequest(Struct, **_STRICT):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    # Default: true for ``prompt`` (as completions), false for ``messages`` (the template
    # adds them), as vLLM does.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    # vLLM accepts these; Rankgate refuses them as its chat endpoint does.
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, **_STRICT):
    tokens: list[Annotated[int, Meta(ge=0, le=2**63 - 1)]]
    model: str | None = None


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


TOKENIZE_DECODER = msgspec.json.Decoder(TokenizeRequest)
DETOKENIZE_DECODER = msgspec.json.Decoder(DetokenizeRequest)
