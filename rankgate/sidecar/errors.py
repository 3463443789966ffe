"""Typed failures of the sidecar; the app maps each type to HTTP in exactly one place.

Every error carries the message a client may see (vLLM's own text for validation failures)
so nothing upstream needs to know about gRPC status codes.
"""

from __future__ import annotations


class SidecarError(Exception):
    """Base of everything the sidecar raises towards the app. ``grpc_status``: the status of
    the engine call it came from, when it came from one (the health probe reads it)."""

    grpc_status: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(SidecarError):
    """The engine rejected the request's content (gRPC INVALID_ARGUMENT): a client mistake.
    ``param`` names the request field at fault, where the sidecar knows it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFound(SidecarError):
    """Unknown model or LoRA adapter (gRPC NOT_FOUND)."""


class FailedPrecondition(SidecarError):
    """The engine cannot serve this kind of request, e.g. LoRA disabled (FAILED_PRECONDITION)."""


class EngineUnavailable(SidecarError):
    """The engine is not ready, restarting or unreachable; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KvLeaseExpired(EngineUnavailable):
    """A disaggregated decode could not start before the prefill engine's KV lease may have
    ended: the blocks it would read may be freed and reused, so it is not sent (HTTP 503 if
    nothing else serves the request)."""


class EngineOverloaded(SidecarError):
    """The engine or the gateway's admission control refused for load (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineFailure(SidecarError):
    """The engine failed the request (INTERNAL, a stream cut short, an unknown status)."""


class DiscoveryError(SidecarError):
    """Discovery found an engine Rankgate must not serve: wrong API, bad topology, drift."""


class BadEngineResponse(SidecarError):
    """An engine answered outside the contract, e.g. a disaggregated prefill that finished
    without the ``kv_transfer_params`` its decode needs: the gateway cannot go on (HTTP 502)."""


class GatewayOverloaded(EngineOverloaded):
    """The gateway's own admission control refused: no slot on an eligible rank and the waiting
    queue full, or no slot freed before the deadline (HTTP 429, ``gateway_overloaded``)."""
