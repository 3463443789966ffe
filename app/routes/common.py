"""What every OpenAI route does the same way: body decoding, ids, headers, state lookup."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Request

from app.admission import Admission, Permit
from app.errors import from_decode_error, invalid
from app.gateway import Gateway
from app.limits import InputLimits, check_depth, read_body
from app.metrics import GatewayMetrics
from app.respond.merge import Primed, close_stream, prime
from sidecar.errors import EngineUnavailable
from sidecar.types import Delta, EngineInfo

T = TypeVar("T")
RANK_HEADER = "x-data-parallel-rank"


def new_id() -> str:
    return os.urandom(12).hex()


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway | None = getattr(request.app.state, "gateway", None)
    if gateway is None:
        raise EngineUnavailable("the gateway is starting", 1.0)
    return gateway


def metrics_of(request: Request) -> GatewayMetrics:
    metrics: GatewayMetrics = request.app.state.metrics
    return metrics


async def decode_body(request: Request, decoder: msgspec.json.Decoder[Any]) -> Any:
    limits: InputLimits = request.app.state.limits
    body = await read_body(request, limits.max_body_bytes)
    if not body:
        raise invalid("the request body is empty; send a JSON object", code="invalid_json")
    check_depth(body, limits.max_json_depth)
    try:
        return decoder.decode(body)
    except msgspec.MsgspecError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise invalid("The request body nests JSON too deeply.", code="json_too_deep") from None
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8: {exc}", code="invalid_json") from None


async def admit(request: Request, info: EngineInfo, weight: int, priority: int) -> Permit:
    """Slots for ``weight`` engine streams (or a 429); release the permit when they end."""
    admission: Admission = request.app.state.admission
    return await admission.acquire(info, weight, priority)


def pinned_rank(request: Request) -> int | None:
    """A client may pin a DP rank with the ``x-data-parallel-rank`` header, as with vLLM."""
    value = request.headers.get(RANK_HEADER)
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit():
        raise invalid(f"header '{RANK_HEADER}' must be a non-negative integer", RANK_HEADER)
    return int(text)


async def whole_body(
    request: Request,
    source: AsyncIterator[Delta],
    build: Callable[[Primed], Awaitable[bytes]],
) -> tuple[bytes, Delta | None] | None:
    """A non-streaming answer: ``build`` over all of ``source``, and the first delta.

    The client is watched from before the engine is asked: a non-streaming request runs as
    unary engine calls with no first token to wait for, and a client that leaves must drop
    them at once. None when the client left; ``source`` is closed either way.
    """

    async def gather() -> tuple[bytes, Delta | None]:
        deltas = await prime(source)
        first = deltas.first
        return await build(deltas), first

    try:
        return await unless_disconnected(request, gather())
    finally:
        await close_stream(source)


async def _disconnected(request: Request, task: asyncio.Task[Any]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; if the client hangs up first, cancel it (dropping the engine streams
    it reads) and return None, as vLLM aborts a request whose client is gone."""
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(_disconnected(request, task))
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            task.uncancel()
            return None
        raise
    finally:
        watcher.cancel()
