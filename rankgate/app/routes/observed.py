"""The frame around each OpenAI route: its request id, its record, and how it ended.

Every answer, errors included, carries ``X-Request-Id``; every request is counted and logged
exactly once, when the client has its last byte (for a stream, when the stream ends).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from rankgate.app.edge.head import RequestHead, read_head
from rankgate.app.edge.request_id import HEADER, is_safe
from rankgate.app.errors import as_api_error
from rankgate.app.observability.record import RequestRecord
from rankgate.app.respond.sse import EventStreamResponse
from rankgate.app.state import state_of

Serve = Callable[[Request, RequestHead, RequestRecord], Awaitable[Response]]
CLIENT_GONE = 499
_HEADER = HEADER.encode()


async def observed(request: Request, endpoint: str, serve: Serve) -> Response:
    """``serve`` answers the request. Its head is read here, once, before anything can be
    refused, so that every answer carries the request's id."""
    state = state_of(request)
    observer = state.observer
    head = read_head(request.scope, state.affinity_header)
    record = observer.begin(endpoint, head.request_id, head.client_named)
    tracing = state.tracing
    if tracing is not None:
        record.trace = tracing.begin(
            request.method, request.url.path, request.headers, record.request_id
        )
    try:
        if head.id_refused is not None:
            raise head.id_refused
        response = await serve(request, head, record)
    except asyncio.CancelledError:
        observer.finish(record, CLIENT_GONE)
        raise
    except Exception as exc:
        error = as_api_error(exc)
        observer.finish(record, error.status)
        response = error.response()
    else:
        if not isinstance(response, EventStreamResponse):
            observer.finish(record, response.status_code)
    response.raw_headers.append((_HEADER, record.request_id.encode("latin-1")))
    return response


# Client-chosen ids repeat across clients, but vLLM and the sidecar key live requests by id:
# those get a suffix unique to this process (and, through the random tag, to this worker).
_PROCESS_TAG = os.urandom(3).hex()
_SERIAL = itertools.count()


def engine_request_id(record: RequestRecord, body_id: str | None) -> str:
    """The id vLLM sees: the client's (body ``request_id``, else ``X-Request-Id``) made unique
    with a suffix, or the gateway's own. A body id also names the record unless the client
    sent a header."""
    if body_id:
        if not record.client_named and is_safe(body_id):
            record.request_id = body_id
        base = body_id
    elif record.client_named:
        base = record.request_id
    else:
        return record.request_id
    return f"{base}-{_PROCESS_TAG}{next(_SERIAL):x}"
