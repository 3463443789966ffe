"""``POST /v1/responses`` and the stored responses behind ``GET/DELETE /v1/responses/{id}``.

A Responses request runs the chat pipeline (``rankgate.app.prepare.responses``): the same render,
tokenization, structured outputs, tool and reasoning parsing, sidecar routing and admission
as ``/v1/chat/completions``; only its input conversion and its output shape are its own.
"""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from rankgate.app.edge.affinity import affinity_key
from rankgate.app.edge.auth import tenant_of
from rankgate.app.edge.head import RequestHead
from rankgate.app.errors import ApiError
from rankgate.app.observability.record import RequestRecord, Tracked
from rankgate.app.prepare.context import PrepareContext
from rankgate.app.prepare.responses import chat_request, renamed
from rankgate.app.respond.document import JsonDocument
from rankgate.app.respond.primed import prime
from rankgate.app.respond.responses import (
    ResponseChunks,
    ResponsesContext,
    initial_response,
    response_body,
    stored_conversation,
)
from rankgate.app.respond.sse import DeltaEvents, EventStreamResponse
from rankgate.app.respond.stream import guarded
from rankgate.app.response_store import ResponseStore
from rankgate.app.routes.common import decode_body, gateway_of, observe_first, whole_body
from rankgate.app.routes.observed import engine_request_id, observed
from rankgate.app.routes.route_header import raw_route_headers, route_headers
from rankgate.app.schemas.openapi import json_response, operation
from rankgate.app.schemas.requests import Message
from rankgate.app.schemas.responses_api import RESPONSES_DECODER, ResponseDeleted, ResponseObject
from rankgate.app.serving.fastpath import HotRoute
from rankgate.app.state import state_of

router = APIRouter()
_ENCODER = msgspec.json.Encoder()


def store_of(request: Request) -> ResponseStore:
    return state_of(request).responses


async def create_response(request: Request) -> Response:
    return await observed(request, "responses", _serve)


ROUTE = HotRoute(
    "/v1/responses",
    create_response,
    summary="Create a model response",
    openapi=operation("ResponsesRequest", "ResponseObject", "ResponseStreamEvent"),
)


async def _serve(request: Request, head: RequestHead, record: RequestRecord) -> Response:
    gateway = gateway_of(request)
    store = store_of(request)
    tenant = head.tenant
    req, head = await decode_body(request, head, RESPONSES_DECODER)
    target = await gateway.models.resolve(req.model)
    info = gateway.engine.info
    record.model = req.model
    record.stream = req.stream
    history: list[Message] = []
    response_id = store.new_id()
    # A chain is one conversation: every response of it carries the key of its first one.
    chain = response_id
    if req.previous_response_id is not None:
        history = store.conversation(req.previous_response_id, tenant)
        chain = store.chain(req.previous_response_id, tenant) or req.previous_response_id
    affinity = affinity_key(head, req.prompt_cache_key, chain)
    limits = state_of(request).limits
    turn = chat_request(req, history, ignore_unknown=not limits.reject_unknown_fields)
    rid = engine_request_id(record, req.request_id)
    trace = record.trace
    preparing = PrepareContext(
        request_id=rid,
        lora_name=target.lora_name,
        max_model_len=info.max_model_len,
        rank=head.pinned_rank(),
        affinity=affinity,
        trace=trace,
        # The stored conversation is rendered too: it counts toward the work.
        body_size=head.body_size + (len(msgspec.json.encode(history)) if history else 0),
    )
    work = gateway.chat.prepare(turn.chat, preparing)
    try:
        prepared = await (work if trace is None else trace.prepare(work))
    except ApiError as exc:
        raise renamed(exc, turn) from None
    tokenizer = gateway.tokenizer

    def keep(response: ResponseObject, body: bytes) -> None:
        store.put(
            response.id, body, stored_conversation(turn.conversation, response), tenant, chain
        )

    ctx = ResponsesContext(
        base=initial_response(req, response_id, int(time.time())),
        plan=prepared.plan,
        prompt_len=prepared.prompt_len,
        count_tokens=lambda text: len(tokenizer.encode(text, False)),
        on_done=keep if req.store else None,
    )
    if not req.stream:
        source = Tracked(gateway.engine.generate(prepared.request), record)
        body, first = await whole_body(source, lambda deltas: response_body(ctx, deltas))
        gateway.chat.observe(prepared, first)
        return JsonDocument(body, raw_route_headers(first))
    deltas = await prime(Tracked(gateway.engine.generate(prepared.request), record))
    await observe_first(gateway.chat, prepared, deltas)
    observer = state_of(request).observer

    def done(status: int) -> None:
        observer.finish(record, status)

    events = guarded(DeltaEvents(ResponseChunks(ctx), deltas), deltas, done)
    return EventStreamResponse(events, route_headers(deltas.first))


@router.get(
    "/v1/responses/{response_id}",
    response_class=Response,
    summary="Retrieve a stored response",
    responses=json_response("ResponseObject"),
)
async def get_response(response_id: str, request: Request) -> Response:
    body = store_of(request).body(response_id, tenant_of(request.scope))
    return Response(body, media_type="application/json")


@router.delete(
    "/v1/responses/{response_id}",
    response_class=Response,
    summary="Delete a stored response",
    responses=json_response("ResponseDeleted"),
)
async def delete_response(response_id: str, request: Request) -> Response:
    store_of(request).delete(response_id, tenant_of(request.scope))
    return Response(_ENCODER.encode(ResponseDeleted(id=response_id)), media_type="application/json")
