"""The frame around each OpenAI route: its request id, its record, and how it ended.

Every answer, errors included, carries ``X-Request-Id``; every request is counted and logged
exactly once, when the client has its last byte (for a stream, when the stream ends).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from app.errors import as_api_error
from app.observe import RequestRecord, observer_of
from app.request_id import HEADER, from_header, is_safe
from app.respond.sse import EventStreamResponse

Serve = Callable[[Request, RequestRecord], Awaitable[Response]]
CLIENT_GONE = 499


async def observed(request: Request, endpoint: str, serve: Serve) -> Response:
    observer = observer_of(request)
    header = request.headers.get(HEADER)
    request_id, problem = from_header(header)
    record = observer.begin(endpoint, request_id, header is not None and problem is None)
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
    response.headers[HEADER] = record.request_id
    return response


def engine_request_id(record: RequestRecord, body_id: str | None) -> str:
    """The id vLLM sees: the body's ``request_id`` when given (as with vLLM's own server),
    else the record's. A body id also names the record unless the client sent a header."""
    if not body_id:
        return record.request_id
    if not record.client_named and is_safe(body_id):
        record.request_id = body_id
    return body_id
