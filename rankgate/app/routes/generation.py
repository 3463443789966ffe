"""What the generation routes share: the request prepared for the engine, the context its
answer is written in, and that answer built from the engine's deltas, as one JSON body or as
an event stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Literal, Protocol, TypeVar

from fastapi import Request
from starlette.responses import Response

from rankgate.app.edge.affinity import affinity_key
from rankgate.app.edge.head import RequestHead
from rankgate.app.gateway import Gateway
from rankgate.app.observability.record import RequestRecord, Tracked
from rankgate.app.parsers import OutputPlan
from rankgate.app.prepare.context import PrepareContext
from rankgate.app.respond.context import NO_PARSING, ResponseContext
from rankgate.app.respond.document import JsonDocument
from rankgate.app.respond.logprobs import LogprobFormatter
from rankgate.app.respond.primed import close_stream, prime
from rankgate.app.respond.sse import EventStreamResponse
from rankgate.app.respond.stream import guarded
from rankgate.app.routes.common import whole_body
from rankgate.app.routes.observed import engine_request_id
from rankgate.app.routes.route_header import raw_route_headers, route_headers
from rankgate.app.schemas.requests import SamplingFields
from rankgate.app.state import state_of
from rankgate.sidecar import Delta

Req = TypeVar("Req", bound=SamplingFields, contravariant=True)
Prep = TypeVar("Prep", covariant=True)
Ctx = TypeVar("Ctx")


class Preparer(Protocol[Req, Prep]):
    def prepare(self, req: Req, ctx: PrepareContext) -> Awaitable[Prep]: ...


async def prepare(
    head: RequestHead,
    record: RequestRecord,
    gateway: Gateway,
    preparer: Preparer[Req, Prep],
    req: Req,
) -> Prep:
    """``req`` prepared for the engine serving the model it names, its preparation traced
    when the request is; the record learns the model, ``stream`` and ``n``."""
    target = await gateway.models.resolve(req.model)
    info = gateway.engine.info
    record.model = req.model
    record.stream = req.stream
    record.n = req.n
    trace = record.trace
    ctx = PrepareContext(
        request_id=engine_request_id(record, req.request_id),
        lora_name=target.lora_name,
        max_model_len=info.max_model_len,
        rank=head.pinned_rank(),
        trace=trace,
        body_size=head.body_size,
        affinity=affinity_key(head, req.prompt_cache_key),
    )
    work = preparer.prepare(req, ctx)
    return await (work if trace is None else trace.prepare(work))


def response_context(
    gateway: Gateway,
    record: RequestRecord,
    req: SamplingFields,
    kind: Literal["chat", "completion"],
    prompt_lengths: tuple[int, ...],
    top_logprobs: int | None,
    *,
    plan: OutputPlan = NO_PARSING,
    echo: tuple[str, ...] | None = None,
    prompt_logprobs: int | None = None,
    echo_only: bool = False,
) -> ResponseContext:
    """How the answer to ``req`` is written: its id, usage and logprob options."""
    options = req.stream_options
    as_ids = req.return_tokens_as_token_ids
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return ResponseContext(
        kind=kind,
        response_id=f"{prefix}-{req.request_id or record.request_id}",
        created=int(time.time()),
        model=req.model,
        n=req.n,
        prompt_lengths=prompt_lengths,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
        logprobs=None
        if top_logprobs is None
        else LogprobFormatter(gateway.tokenizer, top_logprobs, as_ids),
        prompt_logprobs=None
        if prompt_logprobs is None
        else LogprobFormatter(gateway.tokenizer, prompt_logprobs, as_ids),
        plan=plan,
        echo=echo,
        echo_only=echo_only,
    )


async def answer(
    request: Request,
    record: RequestRecord,
    source: AsyncIterator[Delta],
    ctx: Ctx,
    body: Callable[[Ctx, AsyncIterator[Delta]], Awaitable[bytes]],
    events: Callable[[Ctx, AsyncIterator[Delta]], AsyncIterable[bytes]],
    *,
    stream: bool,
    on_first: Callable[[Delta | None], None] | None = None,
) -> Response:
    """The answer from ``source``, the engine's deltas: ``body`` as one JSON document, or
    ``events`` as a server-sent event stream once the first delta is in (so an error before
    it is still a plain error response). ``on_first`` sees the first delta either way; when
    it refuses the request (raises), the engine's streams are closed first."""
    tracked = Tracked(source, record)
    if not stream:
        document, first = await whole_body(tracked, lambda deltas: body(ctx, deltas))
        if on_first is not None:
            on_first(first)
        return JsonDocument(document, raw_route_headers(first))
    deltas = await prime(tracked)
    if on_first is not None:
        try:
            on_first(deltas.first)
        except BaseException:
            await close_stream(deltas)
            raise
    observer = state_of(request).observer

    def done(status: int) -> None:
        observer.finish(record, status)

    return EventStreamResponse(
        guarded(events(ctx, deltas), deltas, done), route_headers(deltas.first)
    )
