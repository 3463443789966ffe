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

from rankgate.app.edge.headers import request_header
from rankgate.app.edge.request_id import HEADER, from_header, is_safe
from rankgate.app.errors import as_api_error
from rankgate.app.observability.record import RequestRecord
from rankgate.app.respond.sse import EventStreamResponse
from rankgate.app.state import state_of

Serve = Callable[[Request, RequestRecord], Awaitable[Response]]
CLIENT_GONE = 499
_HEADER = HEADER.encode()


async def observed(request: Request, endpoint: str, serve: Serve) -> Response:
    state = state_of(request)
    observer = state.observer
    header = request_header(request, _HEADER)
    request_id, problem = from_header(header)
    record = observer.begin(endpoint, request_id, header is not None and problem is None)
    tracing = state.tracing
    if tracing is not None:
        record.trace = tracing.begin(
            request.method, request.url.path, request.headers, record.request_id
        )
    try:
        if problem is not None:
            raise problem
        response = await serve(request, record)
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
