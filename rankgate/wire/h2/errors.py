"""What the core raises: a connection error ends the connection, a stream error one stream.

Both carry the RFC 9113 error code that went (or goes) to the peer in GOAWAY or RST_STREAM.
"""

from __future__ import annotations

from rankgate.wire.h2.frames import ErrorCode


class H2Error(Exception):
    """An HTTP/2 failure; ``code`` is the RFC 9113 error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class H2ConnectionError(H2Error):
    """The peer broke the protocol for the whole connection: GOAWAY was sent, nothing more
    may be read from it."""


class H2StreamError(H2Error):
    """The peer broke the protocol on one stream: it was reset, the connection goes on."""

    def __init__(self, stream_id: int, code: ErrorCode, message: str) -> None:
        super().__init__(code, message)
        self.stream_id = stream_id


class StreamIdsExhausted(H2Error):
    """Every client stream id of this connection is used: new streams need a new one."""

    def __init__(self) -> None:
        super().__init__(ErrorCode.NO_ERROR, "stream ids exhausted on this connection")
