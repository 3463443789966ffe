"""``POST /v1/chat/completions``."""

from __future__ import annotations

from fastapi import Request
from starlette.responses import Response

from rankgate.app.edge.head import RequestHead
from rankgate.app.observability.record import RequestRecord
from rankgate.app.respond.complete import chat_completion
from rankgate.app.respond.stream import chat_events
from rankgate.app.routes.common import decode_body, gateway_of
from rankgate.app.routes.generation import answer, prepare, response_context
from rankgate.app.routes.observed import observed
from rankgate.app.schemas.openapi import operation
from rankgate.app.schemas.requests import CHAT_DECODER
from rankgate.app.serving.fastpath import HotRoute
from rankgate.sidecar import Delta


async def create_chat_completion(request: Request) -> Response:
    return await observed(request, "chat", _serve)


ROUTE = HotRoute(
    "/v1/chat/completions",
    create_chat_completion,
    summary="Create a chat completion",
    openapi=operation("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
)


async def _serve(request: Request, head: RequestHead, record: RequestRecord) -> Response:
    gateway = gateway_of(request)
    req, head = await decode_body(request, head, CHAT_DECODER)
    prepared = await prepare(head, record, gateway, gateway.chat, req)
    ctx = response_context(
        gateway,
        record,
        req,
        "chat",
        (prepared.prompt_len,),
        prepared.top_logprobs,
        plan=prepared.plan,
        prompt_logprobs=prepared.prompt_logprobs,
    )

    def observe(first: Delta | None) -> None:
        gateway.chat.observe(prepared, first)

    source = gateway.engine.generate(prepared.request)
    return await answer(
        request,
        record,
        source,
        ctx,
        chat_completion,
        chat_events,
        stream=req.stream,
        on_first=observe,
    )
