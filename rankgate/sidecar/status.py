"""The one mapping from what can go wrong on an engine call to the sidecar's typed errors.

Every failure of an engine call, whatever layer noticed it, ends as a gRPC status and then as
a :mod:`rankgate.sidecar.errors` type here: a ``grpc-status`` trailer, an HTTP status other than
200, an RST_STREAM from the engine, an HTTP/2 protocol violation, or a failure of the connection
itself (which the HTTP/2 client words as UNAVAILABLE or INTERNAL, as gRPC's own transports
do). The translations of HTTP statuses and reset codes follow gRPC's
``doc/http-grpc-status-mapping.md`` and ``doc/PROTOCOL-HTTP2.md``.

vLLM's own message is kept for client mistakes (it names the offending field); engine-side
failures keep the status name too, so logs tell an INTERNAL from a cut connection.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

from rankgate.sidecar.errors import (
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    SidecarError,
)
from rankgate.wire.h2.errors import H2Error
from rankgate.wire.h2.frames import ErrorCode

if TYPE_CHECKING:
    import grpc


class Status(IntEnum):
    """gRPC status codes (``grpc/status.h``), without depending on grpcio."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


_STATUSES = {int(code): code for code in Status}

_CLIENT_ERRORS: dict[Status, type[SidecarError]] = {
    Status.INVALID_ARGUMENT: InvalidRequest,
    Status.OUT_OF_RANGE: InvalidRequest,
    Status.NOT_FOUND: NotFound,
    Status.FAILED_PRECONDITION: FailedPrecondition,
}
_UNAVAILABLE = frozenset({Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED, Status.CANCELLED})

# An HTTP status other than 200 on a gRPC response; any other is UNKNOWN.
HTTP_STATUS: dict[str, Status] = {
    "400": Status.INTERNAL,
    "401": Status.UNAUTHENTICATED,
    "403": Status.PERMISSION_DENIED,
    "404": Status.UNIMPLEMENTED,
    "429": Status.UNAVAILABLE,
    "502": Status.UNAVAILABLE,
    "503": Status.UNAVAILABLE,
    "504": Status.UNAVAILABLE,
}
# An RST_STREAM from the engine; any other code is INTERNAL.
RESET_STATUS: dict[int, Status] = {
    ErrorCode.REFUSED_STREAM: Status.UNAVAILABLE,
    ErrorCode.CANCEL: Status.CANCELLED,
    ErrorCode.ENHANCE_YOUR_CALM: Status.RESOURCE_EXHAUSTED,
    ErrorCode.INADEQUATE_SECURITY: Status.PERMISSION_DENIED,
}


def error_from_status(code: int, details: str | None, retry_after: float = 1.0) -> SidecarError:
    """Translate a finished call's status; ``retry_after`` is advertised for transient states.
    A number that is no gRPC status counts as UNKNOWN."""
    status = _STATUSES.get(code, Status.UNKNOWN)
    error = _typed(
        status, (details or "").strip() or status.name.lower().replace("_", " "), retry_after
    )
    error.grpc_status = status
    return error


def _typed(status: Status, text: str, retry_after: float) -> SidecarError:
    client_error = _CLIENT_ERRORS.get(status)
    if client_error is not None:
        return client_error(text)
    if status in _UNAVAILABLE:
        return EngineUnavailable(f"engine unavailable ({status.name}): {text}", retry_after)
    if status is Status.RESOURCE_EXHAUSTED:
        return EngineOverloaded(f"engine overloaded: {text}", retry_after)
    return EngineFailure(f"engine error ({status.name}): {text}")


def error_from_http_status(status: str, retry_after: float = 1.0) -> SidecarError:
    """The engine answered a call with an HTTP status other than 200."""
    code = HTTP_STATUS.get(status, Status.UNKNOWN)
    return error_from_status(
        code, f"the engine answered HTTP status {status or 'none'}", retry_after
    )


def error_from_reset(code: int, retry_after: float = 1.0) -> SidecarError:
    """The engine reset the call's stream with this HTTP/2 error code."""
    status = RESET_STATUS.get(code, Status.INTERNAL)
    return error_from_status(
        status, f"the engine reset the stream (HTTP/2 error {code})", retry_after
    )


def error_from_h2(error: H2Error, retry_after: float = 1.0) -> SidecarError:
    """The engine broke HTTP/2 on the call's stream or its connection."""
    return error_from_status(
        Status.INTERNAL, f"HTTP/2 protocol error ({error.code.name}): {error.message}", retry_after
    )


def error_from_rpc(error: grpc.RpcError, retry_after: float = 1.0) -> SidecarError:
    """A grpcio call failed (the Control, health and KV-transfer services stay on grpcio)."""
    return error_from_status(error.code().value[0], error.details(), retry_after)
