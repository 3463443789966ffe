from __future__ import annotations

import grpc
import pytest

from sidecar.errors import (
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    SidecarError,
)
from sidecar.status import error_from_status


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
        (grpc.StatusCode.OUT_OF_RANGE, InvalidRequest),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.UNAVAILABLE, EngineUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, EngineUnavailable),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, EngineOverloaded),
        (grpc.StatusCode.INTERNAL, EngineFailure),
        (grpc.StatusCode.UNKNOWN, EngineFailure),
        (grpc.StatusCode.UNIMPLEMENTED, EngineFailure),
        (grpc.StatusCode.DATA_LOSS, EngineFailure),
    ],
)
def test_each_status_has_one_type(code: grpc.StatusCode, kind: type[SidecarError]) -> None:
    assert type(error_from_status(code, "boom")) is kind


def test_client_errors_keep_vllm_message_verbatim() -> None:
    error = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, " top_p must be in (0, 1] ")
    assert error.message == "top_p must be in (0, 1]"


def test_transient_errors_carry_retry_after() -> None:
    unavailable = error_from_status(grpc.StatusCode.UNAVAILABLE, "conn refused", retry_after=3.0)
    overloaded = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "", retry_after=2.0)
    assert isinstance(unavailable, EngineUnavailable)
    assert unavailable.retry_after == 3.0
    assert isinstance(overloaded, EngineOverloaded)
    assert overloaded.retry_after == 2.0
    assert "resource exhausted" in overloaded.message


def test_engine_failures_name_the_status() -> None:
    assert "INTERNAL" in error_from_status(grpc.StatusCode.INTERNAL, "oops").message
