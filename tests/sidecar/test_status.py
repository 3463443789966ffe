"""The one mapping from engine-call failures to the sidecar's typed errors (sidecar.status).

One table: every way an Inference call can fail on the wire (a grpc-status trailer, an HTTP
status, an RST_STREAM code, an HTTP/2 protocol violation, the connection's own failures as
the HTTP/2 client words them) and every grpcio status of the Control path, with the error
type and the words of its message.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from rankgate.sidecar.errors import (
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    SidecarError,
)
from rankgate.sidecar.status import (
    Status,
    error_from_h2,
    error_from_http_status,
    error_from_reset,
    error_from_rpc,
    error_from_status,
)
from rankgate.wire.h2.errors import H2ConnectionError, H2StreamError
from rankgate.wire.h2.frames import ErrorCode

Case = tuple[str, Callable[[], SidecarError], type[SidecarError], str]


class _RpcError(grpc.aio.AioRpcError):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


TABLE: list[Case] = [
    # grpc-status trailers
    ("INVALID_ARGUMENT", lambda: error_from_status(3, "top_p must be in (0, 1]"), InvalidRequest,
     "top_p must be in (0, 1]"),
    ("OUT_OF_RANGE", lambda: error_from_status(11, "too long"), InvalidRequest, "too long"),
    ("NOT_FOUND", lambda: error_from_status(5, "model missing"), NotFound, "model missing"),
    ("FAILED_PRECONDITION", lambda: error_from_status(9, "LoRA off"), FailedPrecondition,
     "LoRA off"),
    ("UNAVAILABLE", lambda: error_from_status(14, "down"), EngineUnavailable,
     "engine unavailable (UNAVAILABLE): down"),
    ("DEADLINE_EXCEEDED", lambda: error_from_status(4, "late"), EngineUnavailable,
     "(DEADLINE_EXCEEDED): late"),
    ("CANCELLED", lambda: error_from_status(1, ""), EngineUnavailable, "(CANCELLED): cancelled"),
    ("RESOURCE_EXHAUSTED", lambda: error_from_status(8, "queue full"), EngineOverloaded,
     "engine overloaded: queue full"),
    ("INTERNAL", lambda: error_from_status(13, "oops"), EngineFailure,
     "engine error (INTERNAL): oops"),
    ("UNKNOWN", lambda: error_from_status(2, "?"), EngineFailure, "(UNKNOWN): ?"),
    ("UNIMPLEMENTED", lambda: error_from_status(12, "no"), EngineFailure, "(UNIMPLEMENTED): no"),
    ("DATA_LOSS", lambda: error_from_status(15, "lost"), EngineFailure, "(DATA_LOSS): lost"),
    ("PERMISSION_DENIED", lambda: error_from_status(7, "no"), EngineFailure,
     "(PERMISSION_DENIED)"),
    ("not a status", lambda: error_from_status(99, "odd"), EngineFailure, "(UNKNOWN): odd"),
    # HTTP statuses other than 200
    ("HTTP 503", lambda: error_from_http_status("503"), EngineUnavailable,
     "(UNAVAILABLE): the engine answered HTTP status 503"),
    ("HTTP 429", lambda: error_from_http_status("429"), EngineUnavailable, "HTTP status 429"),
    ("HTTP 404", lambda: error_from_http_status("404"), EngineFailure, "(UNIMPLEMENTED)"),
    ("HTTP 400", lambda: error_from_http_status("400"), EngineFailure, "(INTERNAL)"),
    ("HTTP 401", lambda: error_from_http_status("401"), EngineFailure, "(UNAUTHENTICATED)"),
    ("HTTP 418", lambda: error_from_http_status("418"), EngineFailure, "(UNKNOWN)"),
    ("no :status", lambda: error_from_http_status(""), EngineFailure, "HTTP status none"),
    # RST_STREAM from the engine
    ("REFUSED_STREAM", lambda: error_from_reset(ErrorCode.REFUSED_STREAM), EngineUnavailable,
     "(UNAVAILABLE): the engine reset the stream (HTTP/2 error 7)"),
    ("CANCEL", lambda: error_from_reset(ErrorCode.CANCEL), EngineUnavailable, "(CANCELLED)"),
    ("ENHANCE_YOUR_CALM", lambda: error_from_reset(ErrorCode.ENHANCE_YOUR_CALM),
     EngineOverloaded, "HTTP/2 error 11"),
    ("INADEQUATE_SECURITY", lambda: error_from_reset(ErrorCode.INADEQUATE_SECURITY),
     EngineFailure, "(PERMISSION_DENIED)"),
    ("reset INTERNAL_ERROR", lambda: error_from_reset(ErrorCode.INTERNAL_ERROR), EngineFailure,
     "(INTERNAL): the engine reset the stream (HTTP/2 error 2)"),
    ("reset unknown code", lambda: error_from_reset(0x99), EngineFailure, "HTTP/2 error 153"),
    # HTTP/2 protocol violations by the engine
    ("connection error",
     lambda: error_from_h2(H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "a frame of 100000")),
     EngineFailure, "(INTERNAL): HTTP/2 protocol error (FRAME_SIZE_ERROR): a frame of 100000"),
    ("stream error",
     lambda: error_from_h2(H2StreamError(3, ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")),
     EngineFailure, "HTTP/2 protocol error (PROTOCOL_ERROR): WINDOW_UPDATE of 0"),
    # The connection's own failures, as the HTTP/2 client words them
    ("connection lost",
     lambda: error_from_status(Status.UNAVAILABLE, "the connection to the engine was lost"),
     EngineUnavailable, "lost"),
    ("message too large",
     lambda: error_from_status(Status.RESOURCE_EXHAUSTED, "engine message of 9 bytes exceeds 8"),
     EngineOverloaded, "exceeds 8"),
    # grpcio errors of the Control path
    ("grpcio NOT_FOUND", lambda: error_from_rpc(_RpcError(grpc.StatusCode.NOT_FOUND, "gone")),
     NotFound, "gone"),
    ("grpcio UNAVAILABLE",
     lambda: error_from_rpc(_RpcError(grpc.StatusCode.UNAVAILABLE, "refused")),
     EngineUnavailable, "(UNAVAILABLE): refused"),
    ("grpcio INTERNAL", lambda: error_from_rpc(_RpcError(grpc.StatusCode.INTERNAL, "x")),
     EngineFailure, "(INTERNAL): x"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "kind", "words"), [c[1:] for c in TABLE], ids=[c[0] for c in TABLE]
)
def test_each_failure_maps_to_one_type(
    make: Callable[[], SidecarError], kind: type[SidecarError], words: str
) -> None:
    error = make()
    assert type(error) is kind
    assert words in error.message


def test_our_status_codes_are_grpcs() -> None:
    assert {code.name: code.value for code in Status} == {
        code.name: code.value[0] for code in grpc.StatusCode
    }


def test_client_errors_keep_vllm_message_verbatim() -> None:
    error = error_from_status(Status.INVALID_ARGUMENT, " top_p must be in (0, 1] ")
    assert error.message == "top_p must be in (0, 1]"


def test_transient_errors_carry_retry_after() -> None:
    unavailable = error_from_status(Status.UNAVAILABLE, "conn refused", retry_after=3.0)
    overloaded = error_from_status(Status.RESOURCE_EXHAUSTED, "", retry_after=2.0)
    reset = error_from_reset(ErrorCode.REFUSED_STREAM, retry_after=4.0)
    assert isinstance(unavailable, EngineUnavailable)
    assert unavailable.retry_after == 3.0
    assert isinstance(overloaded, EngineOverloaded)
    assert overloaded.retry_after == 2.0
    assert "resource exhausted" in overloaded.message
    assert isinstance(reset, EngineUnavailable)
    assert reset.retry_after == 4.0
