"""The core's record of one HTTP/2 stream, which a role subclasses for its hooks."""

from __future__ import annotations

from rankgate.wire.h2.errors import H2StreamError
from rankgate.wire.h2.frames import DEFAULT_WINDOW

# A stream's receive states (RFC 9113 section 8.1: header block, DATA, optional trailers).
AWAITING_HEADERS, RECEIVING, REMOTE_CLOSED = range(3)


class H2Stream:
    """The core's record of one stream; a role subclasses it and overrides the hooks."""

    __slots__ = (
        "pending",
        "pending_end",
        "recv_state",
        "recv_window",
        "send_window",
        "stream_id",
    )

    def __init__(self) -> None:
        self.stream_id = 0
        self.send_window = DEFAULT_WINDOW
        self.recv_window = DEFAULT_WINDOW
        # What the peer may send next: its header block, DATA and trailers, or nothing.
        self.recv_state = AWAITING_HEADERS
        # DATA waiting for the peer's windows, and whether END_STREAM goes with its last byte.
        self.pending: bytearray | None = None
        self.pending_end = False

    @property
    def remote_closed(self) -> bool:
        """The peer ended its side of the stream."""
        return self.recv_state == REMOTE_CLOSED

    def on_headers(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        """A complete header block (response headers or trailers; the list is shared)."""

    def on_data(self, data: bytes, flow: int, end_stream: bool) -> None:
        """DATA without padding; ``flow`` is what it counted against the windows."""

    def on_reset(self, code: int) -> None:
        """The peer reset the stream (it is no longer known to the connection)."""

    def on_stream_error(self, error: H2StreamError) -> None:
        """The peer broke the protocol on this stream; the core has reset it."""

    def on_drained(self) -> None:
        """Everything :meth:`~rankgate.wire.h2.sending.H2Sending.send_data` held back has been
        sent."""
