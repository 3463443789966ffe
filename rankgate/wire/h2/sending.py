"""One HTTP/2 connection's state and its sending side, without I/O (see :mod:`rankgate.wire.h2`).

Everything the core sends is queued in ``out``; the role hands it to its transport when it
suits it (``data_to_send``), so one received chunk or one batch of messages costs one write.
Send flow control: :meth:`H2Sending.send_data` sends what the peer's windows and frame size
allow and keeps the rest on the stream until WINDOW_UPDATE or SETTINGS open room. The frame
parser, which moves this state as frames arrive, is
:class:`rankgate.wire.h2.connection.H2Connection`.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from rankgate.wire.h2.errors import StreamIdsExhausted
from rankgate.wire.h2.frames import (
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    FRAME_HEAD,
    GOAWAY,
    GOAWAY_HEAD,
    HEADERS,
    MAX_STREAM_ID,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS_INITIAL_WINDOW_SIZE,
    U32,
    WINDOW_UPDATE,
    ErrorCode,
    frame,
    frame_head,
    settings_frame,
)
from rankgate.wire.h2.headers import HeaderDecoder
from rankgate.wire.h2.stream import RECEIVING, REMOTE_CLOSED, H2Stream

# A header block (HEADERS and its CONTINUATIONs) larger than this, or split into more frames,
# ends the connection before it is decoded: the CONTINUATION flood of RFC 9113 section 10.5.
MAX_HEADER_BLOCK = 64 << 10
MAX_HEADER_FRAMES = 64
# Streams this end reset whose late frames are still ignored, newest kept.
RESET_MEMORY = 4096

_PROTOCOL_ERROR = ErrorCode.PROTOCOL_ERROR
_FRAME_SIZE_ERROR = ErrorCode.FRAME_SIZE_ERROR
_FLOW_CONTROL_ERROR = ErrorCode.FLOW_CONTROL_ERROR
_STREAM_CLOSED = ErrorCode.STREAM_CLOSED
# A HEADERS frame whose flags among these are END_HEADERS alone carries a whole, bare block.
_BLOCK_FLAGS = PADDED | PRIORITY_FLAG | END_HEADERS


S = TypeVar("S", bound=H2Stream)


class H2Sending(Generic[S]):
    """The protocol state of one connection, for the client or the server end, and everything
    that sends; :class:`~rankgate.wire.h2.connection.H2Connection` adds the frame parser."""

    def __init__(
        self,
        *,
        client: bool,
        settings: tuple[tuple[int, int], ...] = (),
        connection_window: int = DEFAULT_WINDOW,
        connection_credit_step: int | None = None,
        max_header_block: int = MAX_HEADER_BLOCK,
    ) -> None:
        self.client = client
        # Frames to send, in order; the role hands them to its transport (data_to_send).
        self.out: list[bytes] = []
        self.streams: dict[int, S] = {}
        self.closed = False
        self._local_settings = settings
        self.local_initial_window = DEFAULT_WINDOW
        for key, value in settings:
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                self.local_initial_window = value
        self.peer_max_frame = DEFAULT_MAX_FRAME
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_streams = MAX_STREAM_ID
        self.send_window = DEFAULT_WINDOW
        self._blocked: deque[S] = deque()
        self._connection_window = connection_window
        self._recv_window = connection_window
        # The connection window is re-opened in full once it is this low.
        self._grant_below = connection_window - (connection_credit_step or MAX_WINDOW + 1)
        self._buffer = b""
        self._preface_left = b"" if client else PREFACE
        self._awaiting_settings = True
        self._decoder = HeaderDecoder(max_header_block)
        self._max_header_block = max_header_block
        self._header_block: bytearray | None = None
        self._header_stream = 0
        self._header_end = False
        self._header_frames = 0
        # Client: the id the next stream gets. Server: the highest id the peer opened.
        self.next_stream_id = 1
        self.last_peer_stream = 0
        self._resets: dict[int, None] = {}

    # ---------------------------------------------------------------- hooks (the role's)

    def on_new_stream(self, stream_id: int, headers: list[tuple[str, str]], end: bool) -> None:
        """Server: the peer opened a stream; :meth:`add_stream` or :meth:`refuse` it."""
        self.refuse(stream_id, ErrorCode.REFUSED_STREAM)

    def on_settings(self) -> None:
        """The peer's SETTINGS were applied (limits may have grown)."""

    def on_goaway(self, last_stream_id: int, code: int, debug: bytes) -> None:
        """The peer takes no stream above ``last_stream_id``."""

    def on_ping_ack(self, payload: bytes) -> None:
        """The peer answered a PING."""

    # ---------------------------------------------------------------- sending

    def data_to_send(self) -> bytes:
        """Everything queued to send since the last call, as one write."""
        out = self.out
        if not out:
            return b""
        data = b"".join(out)
        out.clear()
        return data

    def initiate(self) -> None:
        """This end's connection preface: the client magic, SETTINGS, and the room beyond the
        default connection window."""
        out = settings_frame(self._local_settings)
        if self.client:
            out = PREFACE + out
        extra = self._connection_window - DEFAULT_WINDOW
        if extra > 0:
            out += frame(WINDOW_UPDATE, 0, 0, U32.pack(extra))
        self.out.append(out)

    @property
    def can_open(self) -> bool:
        """Client: whether a stream id is left on this connection."""
        return self.next_stream_id <= MAX_STREAM_ID

    def open_stream(self, stream: S) -> int:
        """Client: give ``stream`` the next id and track it; its HEADERS are the caller's."""
        stream_id = self.next_stream_id
        if stream_id > MAX_STREAM_ID:
            raise StreamIdsExhausted()
        self.next_stream_id = stream_id + 2
        stream.stream_id = stream_id
        stream.send_window = self.peer_initial_window
        stream.recv_window = self.local_initial_window
        self.streams[stream_id] = stream
        return stream_id

    def add_stream(self, stream: S, stream_id: int, end_stream: bool) -> None:
        """Server: track a stream the peer opened (from ``on_new_stream``)."""
        self._track(stream, stream_id)
        stream.recv_state = REMOTE_CLOSED if end_stream else RECEIVING

    def _track(self, stream: S, stream_id: int) -> None:
        stream.stream_id = stream_id
        stream.send_window = self.peer_initial_window
        stream.recv_window = self.local_initial_window
        self.streams[stream_id] = stream

    def close_stream(self, stream: S) -> None:
        """Forget a stream that is over for this end (no RST_STREAM sent)."""
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]
            if stream.recv_state != REMOTE_CLOSED:
                # The peer may still be sending on it: late frames are not an error.
                self._remember_reset(stream.stream_id)

    def reset_stream(self, stream: S, code: int) -> None:
        """RST_STREAM towards the peer; the stream is forgotten, its late frames ignored."""
        stream_id = stream.stream_id
        if self.streams.get(stream_id) is stream:
            del self.streams[stream_id]
            self._remember_reset(stream_id)
            self.out.append(frame(RST_STREAM, 0, stream_id, U32.pack(code)))

    def refuse(self, stream_id: int, code: int) -> None:
        """Server: reset a stream the peer opened that was never tracked."""
        self._remember_reset(stream_id)
        self.out.append(frame(RST_STREAM, 0, stream_id, U32.pack(code)))

    def _remember_reset(self, stream_id: int) -> None:
        resets = self._resets
        resets[stream_id] = None
        if len(resets) > RESET_MEMORY:
            del resets[next(iter(resets))]

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        """A header block, split into HEADERS and CONTINUATION at the peer's frame size."""
        size = len(block)
        if size <= self.peer_max_frame:
            flags = END_STREAM | END_HEADERS if end_stream else END_HEADERS
            self.out.append(
                FRAME_HEAD.pack(size >> 8, size & 0xFF, HEADERS, flags, stream_id) + block
            )
            return
        self.out.append(self.header_frames(stream_id, block, end_stream))

    def header_frames(self, stream_id: int, block: bytes, end_stream: bool) -> bytes:
        """The frames :meth:`send_headers` would write."""
        flags = END_STREAM if end_stream else 0
        limit = self.peer_max_frame
        if len(block) <= limit:
            return frame_head(HEADERS, flags | END_HEADERS, stream_id, len(block)) + block
        parts = [frame_head(HEADERS, flags, stream_id, limit) + block[:limit]]
        at = limit
        while at < len(block):
            chunk = block[at : at + limit]
            at += limit
            last = END_HEADERS if at >= len(block) else 0
            parts.append(frame_head(CONTINUATION, last, stream_id, len(chunk)) + chunk)
        return b"".join(parts)

    def send_data(
        self, stream: S, data: bytes, end_stream: bool = False, prefix: bytes = b""
    ) -> bool:
        """Send ``prefix`` and ``data`` as one DATA payload, as far as the peer's windows and
        frame size allow; the rest waits on the stream and goes out as room opens. True when
        all of it left now. ``prefix`` spares the caller joining a small head (a gRPC message
        head) to a large body."""
        size = len(data) + len(prefix)
        if self.reserve(stream, size):
            flags = END_STREAM if end_stream else 0
            out = self.out
            out.append(
                FRAME_HEAD.pack(size >> 8, size & 0xFF, DATA, flags, stream.stream_id) + prefix
            )
            out.append(data)
            return True
        if prefix:
            data = prefix + data
        if stream.pending is None:
            stream.pending = bytearray(data)
            self._blocked.append(stream)
        else:
            stream.pending += data
        stream.pending_end = end_stream
        self._drain()
        return stream.pending is None

    def reserve(self, stream: S, size: int) -> bool:
        """Take ``size`` bytes of the peer's windows for one DATA frame the caller frames and
        queues itself (a role whose payload has a head of its own saves joining them); False,
        with nothing taken, when such a frame cannot go now (then use :meth:`send_data`)."""
        if (
            stream.pending is None
            and size <= stream.send_window
            and size <= self.send_window
            and size <= self.peer_max_frame
        ):
            stream.send_window -= size
            self.send_window -= size
            return True
        return False

    def _drain(self) -> None:
        """Send what the windows allow of the streams waiting for them, one frame a stream in
        turn. The connection window is shared: drained one stream after another, a short
        request queued behind long prompts waited for all of them to leave first."""
        blocked = self._blocked
        streams = self.streams
        out = self.out
        stalled = 0
        while blocked and self.send_window > 0 and stalled < len(blocked):
            stream = blocked.popleft()
            pending = stream.pending
            if pending is None or streams.get(stream.stream_id) is not stream:
                stream.pending = None
                continue
            if stream.send_window <= 0:
                # Waiting on its own window: the others may still go.
                blocked.append(stream)
                stalled += 1
                continue
            stalled = 0
            size = min(len(pending), self.peer_max_frame, self.send_window, stream.send_window)
            last = size == len(pending)
            flags = END_STREAM if last and stream.pending_end else 0
            out.append(frame_head(DATA, flags, stream.stream_id, size) + pending[:size])
            self.send_window -= size
            stream.send_window -= size
            if not last:
                del pending[:size]
                blocked.append(stream)
                continue
            stream.pending = None
            stream.on_drained()

    def grant(self, stream: S, size: int) -> None:
        """Let the peer send ``size`` more bytes on ``stream``."""
        stream.recv_window += size
        self.out.append(frame(WINDOW_UPDATE, 0, stream.stream_id, U32.pack(size)))

    def send_ping(self, payload: bytes) -> None:
        self.out.append(frame(PING, 0, 0, payload))

    def send_goaway(self, code: int, debug: bytes = b"") -> None:
        last = 0 if self.client else self.last_peer_stream
        self.out.append(frame(GOAWAY, 0, 0, GOAWAY_HEAD.pack(last, code) + debug))
