"""The one error type the mock engine raises towards gRPC: a status code and vLLM's message."""

from __future__ import annotations

import grpc


class RpcStatus(Exception):
    """Ends an RPC with ``code`` and ``message``, worded as real vLLM words it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> RpcStatus:
    return RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> RpcStatus:
    return RpcStatus(grpc.StatusCode.NOT_FOUND, message)


def failed_precondition(message: str) -> RpcStatus:
    return RpcStatus(grpc.StatusCode.FAILED_PRECONDITION, message)


def internal(message: str) -> RpcStatus:
    return RpcStatus(grpc.StatusCode.INTERNAL, message)


def resource_exhausted(message: str) -> RpcStatus:
    return RpcStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


ENGINE_DEAD = "engine core reported fatal failure"
