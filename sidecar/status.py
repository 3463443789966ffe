"""The one mapping from a gRPC status to the sidecar's typed errors.

vLLM's own message is kept for client mistakes (it names the offending field); engine-side
failures keep the status name too, so logs tell an INTERNAL from a cut connection.
"""

from __future__ import annotations

import grpc

from sidecar.errors import (
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    SidecarError,
)

_CLIENT_ERRORS: dict[grpc.StatusCode, type[SidecarError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
}
_UNAVAILABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def error_from_status(
    code: grpc.StatusCode, details: str | None, retry_after: float = 1.0
) -> SidecarError:
    """Translate a finished RPC's status; ``retry_after`` is advertised for transient states."""
    text = (details or "").strip() or code.name.lower().replace("_", " ")
    client_error = _CLIENT_ERRORS.get(code)
    if client_error is not None:
        return client_error(text)
    if code in _UNAVAILABLE:
        return EngineUnavailable(f"engine unavailable ({code.name}): {text}", retry_after)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return EngineOverloaded(f"engine overloaded: {text}", retry_after)
    return EngineFailure(f"engine error ({code.name}): {text}")


def error_from_rpc(error: grpc.RpcError, retry_after: float = 1.0) -> SidecarError:
    return error_from_status(error.code(), error.details(), retry_after)
