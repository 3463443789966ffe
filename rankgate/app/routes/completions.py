"""``POST /v1/completions``: one prompt or a batch, each fanned out to ``n`` choices."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from rankgate.app.edge.head import RequestHead
from rankgate.app.observability.record import RequestRecord
from rankgate.app.respond.complete import completion
from rankgate.app.respond.stream import completion_events
from rankgate.app.routes.common import decode_body, gateway_of
from rankgate.app.routes.generation import answer, prepare, response_context
from rankgate.app.routes.observed import observed
from rankgate.app.schemas.openapi import operation
from rankgate.app.schemas.requests import COMPLETION_DECODER
from rankgate.app.serving.fastpath import HotRoute
from rankgate.sidecar import Delta


async def create_completion(request: Request) -> Response:
    return await observed(request, "completions", _serve)


ROUTE = HotRoute(
    "/v1/completions",
    create_completion,
    summary="Create a text completion",
    openapi=operation("CompletionRequest", "Completion", "Completion"),
)


async def _serve(request: Request, head: RequestHead, record: RequestRecord) -> Response:
    gateway = gateway_of(request)
    req, head = await decode_body(request, head, COMPLETION_DECODER)
    prepared = await prepare(head, record, gateway, gateway.completions, req)
    ctx = response_context(
        gateway,
        record,
        req,
        "completion",
        prepared.prompt_lengths,
        prepared.top_logprobs,
        echo=prepared.echo,
        prompt_logprobs=prepared.prompt_logprobs,
        echo_only=prepared.echo_only,
    )
    engine = gateway.engine
    source: AsyncIterator[Delta]
    if len(prepared.requests) == 1:
        source = engine.generate(prepared.requests[0])
    else:
        # Every prompt's streams admitted as one: the batch runs whole or is refused whole.
        source = engine.generate_batch(prepared.requests, req.n)
    return await answer(
        request, record, source, ctx, completion, completion_events, stream=req.stream
    )
