"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them.

Tokenizing goes through the very code generation uses: a ``prompt`` is encoded as
``/v1/completions`` encodes it, ``messages`` are rendered and encoded by the chat preparer
(images expanded to the tokens the engine makes of them), so a client can count a request's
prompt tokens before sending it.

Both are bounded as generation is: a text surely longer than the context window is refused
without tokenizing it, a prompt or a token list longer than ``max_model_len`` tokens is a 400
(vLLM counts any length; its generation would refuse it), and large bodies are worked on off
the event loop. With API keys set, both need one (vLLM leaves them open).
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from rankgate.app.edge.head import read_head
from rankgate.app.errors import ApiError, invalid, unsupported
from rankgate.app.gateway import Gateway
from rankgate.app.prepare.chat import OFFLOAD_BYTES
from rankgate.app.prepare.params import check_token_ids, refuse_unfitting_text
from rankgate.app.routes.common import decode_body, gateway_of
from rankgate.app.schemas.openapi import json_response
from rankgate.app.schemas.requests import ChatCompletionRequest
from rankgate.app.schemas.tokenize import (
    DETOKENIZE_DECODER,
    TOKENIZE_DECODER,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from rankgate.app.serving.offload import offload

router = APIRouter()
_ENCODER = msgspec.json.Encoder()
_REFUSED = (
    ("chat_template", "is not accepted per request; the operator sets the template"),
    ("media_io_kwargs", "is not supported"),
    ("mm_processor_kwargs", "is not supported"),
)


def _json(value: msgspec.Struct) -> Response:
    return Response(_ENCODER.encode(value), media_type="application/json")


@router.post(
    "/tokenize",
    response_class=Response,
    summary="Tokenize a prompt or a chat as generation would",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/TokenizeRequest"}}
            },
        }
    },
    responses=json_response("TokenizeResponse"),
)
async def tokenize(request: Request) -> Response:
    gateway = gateway_of(request)
    req, head = await decode_body(request, read_head(request.scope, None), TOKENIZE_DECODER)
    if req.model is not None:
        await gateway.models.resolve(req.model)
    size = head.body_size
    max_model_len = gateway.engine.info.max_model_len
    ids = await _tokens(gateway, req, size, max_model_len)
    if len(ids) > max_model_len:
        param = "prompt" if req.prompt is not None else "messages"
        raise too_many_tokens(len(ids), max_model_len, param)
    strs = None
    if req.return_token_strs:
        strings = gateway.tokenizer.token_strings
        strs = await offload(size, strings, ids) if size > OFFLOAD_BYTES else strings(ids)
    return _json(
        TokenizeResponse(
            count=len(ids), max_model_len=max_model_len, tokens=list(ids), token_strs=strs
        )
    )


def too_many_tokens(count: int, max_model_len: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, '{param}' "
        f"has {count} tokens.",
        param=param,
        code="context_length_exceeded",
    )


async def _tokens(
    gateway: Gateway, req: TokenizeRequest, size: int, max_model_len: int
) -> tuple[int, ...]:
    for name, why in _REFUSED:
        if getattr(req, name) is not None:
            raise unsupported(name, why)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("give exactly one of 'prompt' and 'messages'", "prompt")
    if req.prompt is not None:
        if gateway.tokenizer.surely_exceeds(req.prompt, max_model_len):
            raise refuse_unfitting_text(len(req.prompt), max_model_len, "prompt")
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        if size > OFFLOAD_BYTES:
            encoded = await offload(size, gateway.tokenizer.encode, req.prompt, add_special)
        else:
            encoded = gateway.tokenizer.encode(req.prompt, add_special)
        return tuple(encoded)
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    assert req.messages is not None
    chat = ChatCompletionRequest(
        model=req.model or "",
        messages=req.messages,
        add_special_tokens=bool(req.add_special_tokens),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=req.tools,
    )
    return await gateway.chat.tokenize(chat, size, max_model_len)


@router.post(
    "/detokenize",
    response_class=Response,
    summary="Turn token ids back into text",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/DetokenizeRequest"}}
            },
        }
    },
    responses=json_response("DetokenizeResponse"),
)
async def detokenize(request: Request) -> Response:
    gateway = gateway_of(request)
    req, head = await decode_body(request, read_head(request.scope, None), DETOKENIZE_DECODER)
    if req.model is not None:
        await gateway.models.resolve(req.model)

    max_model_len = gateway.engine.info.max_model_len
    if len(req.tokens) > max_model_len:
        raise too_many_tokens(len(req.tokens), max_model_len, "tokens")

    def detokenized() -> str:
        check_token_ids(req.tokens, gateway.tokenizer.vocab_size, "tokens")
        return gateway.tokenizer.decode(req.tokens, skip_special_tokens=False)

    size = head.body_size
    if size > OFFLOAD_BYTES:
        text = await offload(size, detokenized)
    else:
        text = detokenized()
    return _json(DetokenizeResponse(prompt=text))
