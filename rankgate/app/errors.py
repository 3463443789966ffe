"""Every failure a client can see, and its OpenAI error JSON, in one place.

Routes raise :class:`ApiError` (or let a sidecar, media or decoding error through); one table,
keyed by exception type, turns each into ``{"error": {...}}`` with the right status, and a
``Retry-After`` header for 429/503 so well-behaved clients back off instead of hammering. A type
resolves along its MRO to its nearest listed base, so a new subclass answers as its parent does
until it gets a row of its own, whatever the order of the rows.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from rankgate.multimodal import MediaError, MediaOverBudget
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


class _Worded(Protocol):
    message: str


class _Backoff(_Worded, Protocol):
    retry_after: float


_Answer = Callable[[Any], ApiError]
_E = TypeVar("_E", bound=BaseException)


def _says(
    status: int, type: str, code: str, *, param: str | None = None, retry_after: float | None = None
) -> Callable[[_Worded], ApiError]:
    def answer(exc: _Worded) -> ApiError:
        return ApiError(
            status, exc.message, type=type, param=param, code=code, retry_after=retry_after
        )

    return answer


def _client_mistake(exc: InvalidRequest) -> ApiError:
    return ApiError(400, exc.message, type=INVALID_REQUEST, param=exc.param, code="invalid_request")


def _backs_off(status: int, type: str, code: str) -> Callable[[_Backoff], ApiError]:
    """A transient refusal: the error's own ``retry_after`` becomes the ``Retry-After`` header."""

    def answer(exc: _Backoff) -> ApiError:
        return ApiError(status, exc.message, type=type, code=code, retry_after=exc.retry_after)

    return answer


def _itself(exc: ApiError) -> ApiError:
    return exc


def _media(exc: MediaError) -> ApiError:
    """A media item the gateway refused: a 503 to retry when its decoders could not take it
    now, else an ``invalid_<noun>`` (image, audio, video)."""
    if exc.status == 503:
        return ApiError(
            503,
            exc.message,
            type=UNAVAILABLE,
            param="messages",
            code="decoders_unavailable",
            retry_after=1,
        )
    noun = exc.label.partition(" ")[0]
    return ApiError(exc.status, exc.message, param="messages", code=f"invalid_{noun}")


def _media_over_budget(exc: MediaOverBudget) -> ApiError:
    return ApiError(400, exc.message, param="messages", code="context_length_exceeded")


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _framework_http(exc: StarletteHTTPException) -> ApiError:
    kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
    return ApiError(
        exc.status_code, str(exc.detail), type=kind, code=_HTTP_CODES.get(exc.status_code)
    )


def _framework_validation(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return invalid(f"Invalid value for '{loc}': {first.get('msg', 'invalid')}", loc)


def _row(kind: type[_E], answer: Callable[[_E], ApiError]) -> tuple[type[BaseException], _Answer]:
    """One entry of :data:`_ANSWERS`, its answer checked against the type it answers."""
    return kind, answer


# Each exception type a request can end with, and its answer.
_ANSWERS: dict[type[BaseException], _Answer] = dict(
    [
        _row(ApiError, _itself),
        _row(msgspec.MsgspecError, from_decode_error),
        _row(SidecarError, _says(500, SERVER_ERROR, "internal_error")),
        _row(InvalidRequest, _client_mistake),
        _row(NotFound, _says(404, NOT_FOUND, "model_not_found", param="model")),
        _row(FailedPrecondition, _says(400, INVALID_REQUEST, "unsupported")),
        _row(EngineOverloaded, _backs_off(429, RATE_LIMIT, "engine_overloaded")),
        _row(GatewayOverloaded, _backs_off(429, RATE_LIMIT, "gateway_overloaded")),
        _row(EngineUnavailable, _backs_off(503, UNAVAILABLE, "engine_unavailable")),
        _row(DiscoveryError, _says(503, UNAVAILABLE, "engine_unavailable", retry_after=5)),
        _row(EngineFailure, _says(500, SERVER_ERROR, "engine_failure")),
        _row(BadEngineResponse, _says(502, SERVER_ERROR, "bad_engine_response")),
        _row(MediaError, _media),
        _row(MediaOverBudget, _media_over_budget),
        _row(StarletteHTTPException, _framework_http),
        _row(RequestValidationError, _framework_validation),
    ]
)
ANSWERED: frozenset[type[BaseException]] = frozenset(_ANSWERS)


def _answer_for(kind: type[BaseException]) -> _Answer | None:
    for base in kind.__mro__:
        answer = _ANSWERS.get(base)
        if answer is not None:
            return answer
    return None


def as_api_error(exc: BaseException) -> ApiError:
    """Any exception as the error the client sees, the last use of ``exc`` and of the errors
    it came from; unexpected ones are logged with traceback."""
    answer = _answer_for(type(exc))
    if answer is None:
        log.error("unexpected error while serving a request", exc_info=exc)
        error = ApiError(500, "Internal server error", type=SERVER_ERROR, code="internal_error")
    else:
        error = answer(exc)
    _drop_tracebacks(exc)
    return error


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


def install_error_handlers(app: FastAPI) -> None:
    async def on_error(_: Request, exc: Exception) -> Response:
        return as_api_error(exc).response()

    for kind in (*_ANSWERS, Exception):
        app.add_exception_handler(kind, on_error)
