"""What every OpenAI route does the same way: body decoding, ids, state lookup."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgspec
from fastapi import Request

from rankgate.app.edge.head import RequestHead
from rankgate.app.edge.limits import check_content_type, check_shape, read_body
from rankgate.app.errors import ApiError, from_decode_error, invalid
from rankgate.app.gateway import Gateway
from rankgate.app.observability.metrics import GatewayMetrics
from rankgate.app.prepare.chat import ChatPreparer, PreparedChat
from rankgate.app.respond.primed import Primed, close_stream, prime
from rankgate.app.schemas.unknown_fields import decode_ignoring_unknown, unknown_field
from rankgate.app.state import state_of
from rankgate.sidecar import Delta, EngineUnavailable

T = TypeVar("T")


def new_id() -> str:
    return os.urandom(12).hex()


def gateway_of(request: Request) -> Gateway:
    gateway = state_of(request).gateway
    if gateway is None:
        raise EngineUnavailable("the gateway is starting", 1.0)
    return gateway


def metrics_of(request: Request) -> GatewayMetrics:
    return state_of(request).metrics


async def decode_body(
    request: Request, head: RequestHead, decoder: msgspec.json.Decoder[T]
) -> tuple[T, RequestHead]:
    """The body as ``decoder``'s type, after its content type, size and shape are checked,
    and the head with the body's size. Fields no schema knows are ignored, as vLLM does,
    unless the operator asked for them to be refused."""
    limits = state_of(request).limits
    check_content_type(head.content_type)
    body = await read_body(request.receive, head.declared_length, limits.max_body_bytes)
    if not body:
        raise invalid("the request body is empty; send a JSON object", code="invalid_json")
    await check_shape(body, limits)
    head = msgspec.structs.replace(head, body_size=len(body))
    try:
        try:
            return decoder.decode(body), head
        except msgspec.ValidationError as exc:
            if limits.reject_unknown_fields or unknown_field(exc) is None:
                raise
            return decode_ignoring_unknown(body, decoder, exc), head
    except msgspec.MsgspecError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise invalid("The request body nests JSON too deeply.", code="json_too_deep") from None
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8: {exc}", code="invalid_json") from None


async def whole_body(
    source: AsyncIterator[Delta],
    build: Callable[[Primed], Awaitable[bytes]],
) -> tuple[bytes, Delta | None]:
    """A non-streaming answer: ``build`` over all of ``source``, and the first delta.

    A client that hangs up is caught by :class:`rankgate.app.serving.clients.ClientWatch`, which
    watches from the moment the body is read and cancels this task: the cancellation drops the unary
    engine calls at once (there is no first token to wait for). ``source`` is closed either
    way.
    """
    try:
        deltas = await prime(source)
        first = deltas.first
        return await build(deltas), first
    finally:
        await close_stream(source)


async def observe_first(chat: ChatPreparer, prepared: PreparedChat, deltas: Primed) -> None:
    """:meth:`ChatPreparer.observe` on a primed stream: when the engine's expanded prompt
    turns the request away, the stream (and with it the engine request) is closed first."""
    try:
        chat.observe(prepared, deltas.first)
    except ApiError:
        await close_stream(deltas)
        raise
