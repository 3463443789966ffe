"""``POST /v1/chat/completions``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.observe import RequestRecord, Tracked, observer_of
from app.respond.complete import chat_completion
from app.respond.context import ResponseContext
from app.respond.logprobs import LogprobFormatter
from app.respond.merge import prime
from app.respond.sse import EventStreamResponse
from app.respond.stream import chat_events, guarded
from app.routes.common import (
    decode_body,
    gateway_of,
    pinned_rank,
    whole_body,
)
from app.routes.observed import engine_request_id, observed
from app.routes.route_header import route_headers
from app.schemas.openapi import operation
from app.schemas.requests import CHAT_DECODER, ChatCompletionRequest

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_class=Response,
    summary="Create a chat completion",
    **operation("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
)
async def create_chat_completion(request: Request) -> Response:
    return await observed(request, "chat", _serve)


async def _serve(request: Request, record: RequestRecord) -> Response:
    gateway = gateway_of(request)
    req: ChatCompletionRequest = await decode_body(request, CHAT_DECODER)
    target = await gateway.models.resolve(req.model)
    info = gateway.engine.info
    record.model = req.model
    record.stream = req.stream
    record.n = req.n
    rid = engine_request_id(record, req.request_id)
    prepared = await gateway.chat.prepare(
        req,
        request_id=rid,
        lora_name=target.lora_name,
        max_model_len=info.max_model_len,
        rank=pinned_rank(request),
    )
    options = req.stream_options
    ctx = ResponseContext(
        kind="chat",
        response_id=f"chatcmpl-{req.request_id or record.request_id}",
        created=int(time.time()),
        model=req.model,
        n=req.n,
        prompt_lengths=(prepared.prompt_len,),
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
        logprobs=None
        if prepared.top_logprobs is None
        else LogprobFormatter(
            gateway.tokenizer, prepared.top_logprobs, req.return_tokens_as_token_ids
        ),
        plan=prepared.plan,
    )
    if not req.stream:
        source = Tracked(gateway.engine.generate(prepared.request), record)
        body, first = await whole_body(source, lambda deltas: chat_completion(ctx, deltas))
        gateway.chat.observe(prepared, first)
        return Response(body, media_type="application/json", headers=route_headers(first))
    deltas = await prime(Tracked(gateway.engine.generate(prepared.request), record))
    gateway.chat.observe(prepared, deltas.first)
    observer = observer_of(request)

    def done(status: int) -> None:
        observer.finish(record, status)

    events = guarded(chat_events(ctx, deltas), deltas, done)
    return EventStreamResponse(events, route_headers(deltas.first))
