"""Every failure a client can see, and its OpenAI error JSON, in one place.

Routes raise :class:`ApiError` (or let a sidecar error through); the handlers installed by
:func:`install_error_handlers` turn both into ``{"error": {...}}`` with the right status, and a
``Retry-After`` header for 429/503 so well-behaved clients back off instead of hammering.
"""

from __future__ import annotations

import logging
import math
import re

import msgspec
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from rankgate.sidecar import (
    BadEngineResponse,
    DiscoveryError,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    FailedPrecondition,
    GatewayOverloaded,
    InvalidRequest,
    NotFound,
    SidecarError,
)

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"

_JSON = "application/json"
_PATH = re.compile(r" - at `\$\.?(.*)`$")
_KEY_IN_PATH = re.compile(r" - at `key` in `\$\.?(.*)`$")


class ApiError(Exception):
    """An error with its HTTP status and the four OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def response(self) -> Response:
        return Response(self.body(), self.status, self.headers(), media_type=_JSON)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def media_refused(status: int, message: str, noun: str) -> ApiError:
    """A media item the gateway refused (``noun``: image, audio, video): a 503 to retry when
    its decoders could not take it now, else an ``invalid_<noun>``."""
    if status == 503:
        return ApiError(
            503,
            message,
            type=UNAVAILABLE,
            param="messages",
            code="decoders_unavailable",
            retry_after=1,
        )
    return ApiError(status, message, param="messages", code=f"invalid_{noun}")


# nginx's status for a request whose client closed the connection before the answer.
CLIENT_CLOSED = 499


def client_gone(message: str) -> ApiError:
    """The client hung up before its request was complete; counted as 499, never answered."""
    return ApiError(CLIENT_CLOSED, message, code="client_disconnected")


def unsupported(param: str, why: str = "is not supported by this server") -> ApiError:
    return ApiError(400, f"`{param}` {why}", param=param, code="unsupported_parameter")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist.",
        type=INVALID_REQUEST,
        param="model",
        code="model_not_found",
    )


def response_not_found(response_id: str, param: str, workers: int | None = None) -> ApiError:
    """An unknown, expired or deleted stored response; ``workers`` when it was stored by
    another gateway worker, whose store this one cannot read."""
    if workers is not None:
        return ApiError(
            404,
            f"Response with id '{response_id}' was not stored by this gateway worker: with "
            f"{workers} workers, each keeps its own responses, and a follow-up must reach the "
            "worker that stored it (run one worker, or keep the conversation client-side).",
            param=param,
            code="response_on_other_worker",
        )
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return ApiError(404, f"Response with id '{response_id}' not found.", param=param, code=code)


def from_decode_error(exc: msgspec.MsgspecError) -> ApiError:
    """Turn msgspec's message ("Expected `int`, got `str` - at `$.n`") into one naming the field."""
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return invalid(f"The request body is not valid JSON: {text}", code="invalid_json")
    param: str | None = None
    key = _KEY_IN_PATH.search(text)
    match = key or _PATH.search(text)
    if match is not None:
        # msgspec writes a dict value's position as "[...]"; the dict's name is what helps.
        param = match.group(1).replace("[...]", "") or None
        text = text[: match.start()]
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", text)
    if unknown is not None:
        name = unknown.group(1)
        param = f"{param}.{name}" if param else name
        return invalid(f"Unrecognized request argument supplied: {param}", param=param)
    missing = re.fullmatch(r"Object missing required field `(.+)`", text)
    if missing is not None:
        name = missing.group(1)
        param = f"{param}.{name}" if param else name
        return invalid(f"Missing required parameter: '{param}'.", param=param)
    if param is None:
        return invalid(f"Invalid request body: {text}")
    where = f"the keys of '{param}'" if key else f"'{param}'"
    return invalid(f"Invalid value for {where}: {text}.", param=param)


def from_sidecar(exc: SidecarError) -> ApiError:
    if isinstance(exc, InvalidRequest):
        return ApiError(400, exc.message, code="invalid_request")
    if isinstance(exc, NotFound):
        return ApiError(404, exc.message, type=NOT_FOUND, param="model", code="model_not_found")
    if isinstance(exc, FailedPrecondition):
        return ApiError(400, exc.message, code="unsupported")
    if isinstance(exc, EngineOverloaded):
        code = "gateway_overloaded" if isinstance(exc, GatewayOverloaded) else "engine_overloaded"
        return ApiError(429, exc.message, type=RATE_LIMIT, code=code, retry_after=exc.retry_after)
    if isinstance(exc, EngineUnavailable):
        return ApiError(
            503,
            exc.message,
            type=UNAVAILABLE,
            code="engine_unavailable",
            retry_after=exc.retry_after,
        )
    if isinstance(exc, DiscoveryError):
        return ApiError(
            503, exc.message, type=UNAVAILABLE, code="engine_unavailable", retry_after=5
        )
    if isinstance(exc, EngineFailure):
        return ApiError(500, exc.message, type=SERVER_ERROR, code="engine_failure")
    if isinstance(exc, BadEngineResponse):
        return ApiError(502, exc.message, type=SERVER_ERROR, code="bad_engine_response")
    return ApiError(500, exc.message, type=SERVER_ERROR, code="internal_error")


def as_api_error(exc: BaseException) -> ApiError:
    """Any exception as the error the client sees, the last use of ``exc`` and of the errors
    it came from; unexpected ones are logged with traceback."""
    if isinstance(exc, ApiError):
        answer = exc
    elif isinstance(exc, SidecarError):
        answer = from_sidecar(exc)
    elif isinstance(exc, msgspec.MsgspecError):
        answer = from_decode_error(exc)
    else:
        log.error("unexpected error while serving a request", exc_info=exc)
        answer = ApiError(500, "Internal server error", type=SERVER_ERROR, code="internal_error")
    _drop_tracebacks(exc)
    return answer


def _drop_tracebacks(exc: BaseException) -> None:
    """An answered error's traceback holds the frames it passed through, whose locals (the
    request, its engine calls, which keep the error they ended with) hold the error again:
    a cycle that only the cyclic collector would free, on the event loop, long after."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        error = pending.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        if error.__cause__ is not None:
            pending.append(error.__cause__)
        if error.__context__ is not None:
            pending.append(error.__context__)


def status_of(exc: BaseException) -> int:
    """The HTTP status ``exc`` will be answered with (for metrics), without logging it."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, SidecarError):
        return from_sidecar(exc).status
    if isinstance(exc, msgspec.MsgspecError):
        return 400
    return 500


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        return as_api_error(exc).response()

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        error = ApiError(
            exc.status_code, str(exc.detail), type=kind, code=_HTTP_CODES.get(exc.status_code)
        )
        return error.response()

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return invalid(f"Invalid value for '{loc}': {first.get('msg', 'invalid')}", loc).response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(SidecarError, on_api_error)
    app.add_exception_handler(msgspec.MsgspecError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_api_error)
