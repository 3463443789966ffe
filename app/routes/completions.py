"""``POST /v1/completions``: one prompt or a batch, each fanned out to ``n`` choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.observe import RequestRecord, Tracked, observer_of
from app.respond.complete import completion
from app.respond.context import ResponseContext
from app.respond.logprobs import LogprobFormatter
from app.respond.merge import merged, prime
from app.respond.sse import EventStreamResponse
from app.respond.stream import completion_events, guarded
from app.routes.common import (
    decode_body,
    gateway_of,
    pinned_rank,
    whole_body,
)
from app.routes.observed import engine_request_id, observed
from app.routes.route_header import route_headers
from app.schemas.openapi import operation
from app.schemas.requests import COMPLETION_DECODER, CompletionRequest
from sidecar.types import Delta

router = APIRouter()


@router.post(
    "/v1/completions",
    response_class=Response,
    summary="Create a text completion",
    **operation("CompletionRequest", "Completion", "Completion"),
)
async def create_completion(request: Request) -> Response:
    return await observed(request, "completions", _serve)


async def _serve(request: Request, record: RequestRecord) -> Response:
    gateway = gateway_of(request)
    req: CompletionRequest = await decode_body(request, COMPLETION_DECODER)
    target = await gateway.models.resolve(req.model)
    info = gateway.engine.info
    record.model = req.model
    record.stream = req.stream
    record.n = req.n
    rid = engine_request_id(record, req.request_id)
    prepared = await gateway.completions.prepare(
        req,
        request_id=rid,
        lora_name=target.lora_name,
        max_model_len=info.max_model_len,
        rank=pinned_rank(request),
    )
    options = req.stream_options
    ctx = ResponseContext(
        kind="completion",
        response_id=f"cmpl-{req.request_id or record.request_id}",
        created=int(time.time()),
        model=req.model,
        n=req.n,
        prompt_lengths=prepared.prompt_lengths,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
        logprobs=None
        if prepared.top_logprobs is None
        else LogprobFormatter(
            gateway.tokenizer, prepared.top_logprobs, req.return_tokens_as_token_ids
        ),
        echo=prepared.echo,
    )
    engine = gateway.engine
    source: AsyncIterator[Delta]
    if len(prepared.requests) == 1:
        source = engine.generate(prepared.requests[0])
    else:
        source = merged([engine.generate(p) for p in prepared.requests], req.n)
    if not req.stream:
        body, first = await whole_body(
            Tracked(source, record), lambda deltas: completion(ctx, deltas)
        )
        return Response(body, media_type="application/json", headers=route_headers(first))
    deltas = await prime(Tracked(source, record))
    observer = observer_of(request)

    def done(status: int) -> None:
        observer.finish(record, status)

    events = guarded(completion_events(ctx, deltas), deltas, done)
    return EventStreamResponse(events, route_headers(deltas.first))
