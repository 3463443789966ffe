"""``X-Request-Id``: taken from the client when it is a safe token, made up otherwise.

The id names the request in the access log, in the response's ``X-Request-Id`` header and,
unless the body names its own ``request_id``, in vLLM. It is echoed in a header and written to
logs, so it is limited to a short run of characters that can neither break a header nor forge
a log line.
"""

from __future__ import annotations

import os
import re

from rankgate.app.errors import ApiError, invalid

HEADER = "x-request-id"
MAX_LENGTH = 128
_SAFE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
_ID_BYTES = 12
# Ids are cut from the system's random bytes read this many at a time: one getrandom() system
# call a request cost more than the rest of making the id.
_BATCH = 256


class _RandomIds:
    """96-bit ids from ``os.urandom``, read in batches; a forked child drops its parent's
    batch, whose ids the parent hands out too. Used from the event loop's thread."""

    def __init__(self) -> None:
        self._batch = b""
        self._next = 0

    def take(self) -> str:
        start = self._next
        if start >= len(self._batch):
            self._batch = os.urandom(_ID_BYTES * _BATCH)
            start = 0
        self._next = start + _ID_BYTES
        return self._batch[start : start + _ID_BYTES].hex()

    def forget(self) -> None:
        self._batch = b""
        self._next = 0


_IDS = _RandomIds()
os.register_at_fork(after_in_child=_IDS.forget)
new_request_id = _IDS.take


def is_safe(value: str) -> bool:
    return _SAFE.fullmatch(value) is not None


def from_header(value: str | None) -> tuple[str, ApiError | None]:
    """The request's id, and the error to answer with when the client's id is unusable."""
    if value is None:
        return new_request_id(), None
    if is_safe(value):
        return value, None
    return new_request_id(), invalid(
        f"header '{HEADER}' must be 1 to {MAX_LENGTH} characters from A-Z, a-z, 0-9 and '._:@/+=-'",
        param=HEADER,
        code="invalid_request_id",
    )
