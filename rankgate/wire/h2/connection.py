"""One HTTP/2 connection's protocol state, without I/O: bytes in, frames out, hooks called.

A role (client or server) subclasses :class:`H2Connection` and :class:`H2Stream`. It passes
every received chunk to :meth:`H2Connection.receive`, which parses the frames, enforces RFC
9113 and calls the role's hooks: ``on_headers``/``on_data``/``on_reset``/``on_stream_error``/
``on_drained`` on the stream objects, ``on_new_stream``/``on_settings``/``on_goaway``/
``on_ping_ack`` on the connection. Everything the core sends is queued in ``out``; the role
hands it to its transport when it suits it (``data_to_send``), so one received chunk or one
batch of messages costs one write.

The role's stream objects are the core's stream records (they subclass :class:`H2Stream`),
and the hooks are plain method calls from the frame loop: a DATA frame costs no event object
and no extra call layer between the parser and the reader.

Receive flow control: the core tracks both windows the peer may still fill and treats an
overrun as a connection error; the connection window is re-opened by the core itself every
``connection_credit_step`` bytes, a stream's only when its role calls ``grant`` (so a slow
reader can stop its peer). The state and the sending side it parses into are
:class:`rankgate.wire.h2.sending.H2Sending`; the stream record is :mod:`rankgate.wire.h2.stream`.
"""

from __future__ import annotations

import hpack

from rankgate.wire.h2.errors import H2ConnectionError, H2StreamError
from rankgate.wire.h2.frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    END_HEADERS,
    END_STREAM,
    FRAME_HEAD,
    GOAWAY,
    GOAWAY_HEAD,
    HEADERS,
    LARGEST_MAX_FRAME,
    MAX_STREAM_ID,
    MAX_WINDOW,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    PUSH_PROMISE,
    RST_STREAM,
    SETTING,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    U32,
    WINDOW_UPDATE,
    ErrorCode,
    frame,
)
from rankgate.wire.h2.sending import (
    MAX_HEADER_BLOCK,
    MAX_HEADER_FRAMES,
    H2Sending,
    S,
)
from rankgate.wire.h2.stream import AWAITING_HEADERS, RECEIVING, REMOTE_CLOSED, H2Stream

_PROTOCOL_ERROR = ErrorCode.PROTOCOL_ERROR
_FRAME_SIZE_ERROR = ErrorCode.FRAME_SIZE_ERROR
_FLOW_CONTROL_ERROR = ErrorCode.FLOW_CONTROL_ERROR
_STREAM_CLOSED = ErrorCode.STREAM_CLOSED
# A HEADERS frame whose flags among these are END_HEADERS alone carries a whole, bare block.
_BLOCK_FLAGS = PADDED | PRIORITY_FLAG | END_HEADERS


class H2Connection(H2Sending[S]):
    """A connection's protocol state with its frame parser: :meth:`receive` takes the bytes
    received, enforces RFC 9113 and calls the role's hooks."""

    def receive(self, data: bytes) -> None:
        """Handle received bytes. Raises :class:`H2ConnectionError` (after queuing GOAWAY)
        when the peer broke the protocol; the connection is then closed."""
        if self.closed:
            return
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        at = self._take_preface(data) if self._preface_left else 0
        size = len(data)
        if self._awaiting_settings and size - at >= 9:
            self._check_first_frame(data, at)
        streams = self.streams
        unpack = FRAME_HEAD.unpack_from
        max_frame = DEFAULT_MAX_FRAME
        receiving = RECEIVING
        while size - at >= 9:
            hi, lo, kind, flags, stream_id = unpack(data, at)
            length = (hi << 8) | lo
            if length > max_frame:
                raise self._connection_error(
                    _FRAME_SIZE_ERROR, f"a frame of {length} bytes exceeds 16384"
                )
            end = at + 9 + length
            if end > size:
                break
            stream_id &= MAX_STREAM_ID
            if self._header_block is not None and kind != CONTINUATION:
                raise self._connection_error(_PROTOCOL_ERROR, "a header block was interrupted")
            if kind == DATA:
                window = self._recv_window - length
                if window < 0:
                    raise self._connection_error(
                        _FLOW_CONTROL_ERROR, "DATA beyond the connection window"
                    )
                self._recv_window = window
                stream = streams.get(stream_id)
                if stream is None or stream.recv_state != receiving:
                    self._on_stray_data(stream_id, stream)
                else:
                    left = stream.recv_window - length
                    if left < 0:
                        raise self._connection_error(
                            _FLOW_CONTROL_ERROR, "DATA beyond the stream window"
                        )
                    stream.recv_window = left
                    payload = (
                        self._unpadded(data, at, end) if flags & PADDED else data[at + 9 : end]
                    )
                    if flags & END_STREAM:
                        stream.recv_state = REMOTE_CLOSED
                        stream.on_data(payload, length, True)
                    else:
                        stream.on_data(payload, length, False)
                if window <= self._grant_below:
                    credit = self._connection_window - window
                    self._recv_window = self._connection_window
                    self.out.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(credit)))
            elif kind in (HEADERS, CONTINUATION):
                self._on_header_frame(kind, flags, stream_id, data[at + 9 : end])
            else:
                self._on_control(kind, flags, stream_id, data[at + 9 : end])
            if self.closed:
                return
            at = end
        if at < size:
            self._buffer = data[at:]

    def _take_preface(self, data: bytes) -> int:
        """Check what ``data`` holds of the client preface still expected (a server's first
        bytes); the offset past it."""
        expected = self._preface_left
        seen = data[: len(expected)]
        if not expected.startswith(seen):
            raise self._connection_error(_PROTOCOL_ERROR, "not an HTTP/2 client preface")
        self._preface_left = expected[len(seen) :]
        return len(seen)

    def _check_first_frame(self, data: bytes, at: int) -> None:
        """The peer's first frame must be its SETTINGS (RFC 9113 section 3.4)."""
        if data[at + 3] != SETTINGS or data[at + 4] & ACK:
            raise self._connection_error(_PROTOCOL_ERROR, "the peer's first frame is not SETTINGS")
        self._awaiting_settings = False

    def _unpadded(self, data: bytes, at: int, end: int) -> bytes:
        """The payload of the padded DATA frame at ``at`` (ending at ``end``), its padding
        checked and cut."""
        length = end - at - 9
        if not length:
            raise self._connection_error(_FRAME_SIZE_ERROR, "padded DATA without its length")
        pad = data[at + 9]
        if pad >= length:
            raise self._connection_error(_PROTOCOL_ERROR, "DATA padding exceeds the frame")
        return data[at + 10 : end - pad]

    def _connection_error(self, code: ErrorCode, message: str) -> H2ConnectionError:
        """GOAWAY for a connection error; the caller raises what this returns."""
        if not self.closed:
            self.closed = True
            self._buffer = b""
            self.send_goaway(code, message.encode()[:200])
        return H2ConnectionError(code, message)

    def _stream_error(self, stream: S, code: ErrorCode, message: str) -> None:
        self.reset_stream(stream, code)
        stream.pending = None
        stream.on_stream_error(H2StreamError(stream.stream_id, code, message))

    def _is_idle(self, stream_id: int) -> bool:
        """Whether no stream with this id was ever opened (by either end)."""
        if stream_id & 1:
            return (
                stream_id >= self.next_stream_id
                if self.client
                else stream_id > self.last_peer_stream
            )
        return True

    def _closed_frame(self, stream_id: int, what: str) -> None:
        """A frame other than PRIORITY, WINDOW_UPDATE or RST_STREAM on a stream that is not
        open: ignored after this end reset it (frames were in flight), else a connection
        error (RFC 9113 section 5.1; after the peer's own RST_STREAM it asks only for a stream
        error, but such a peer is broken)."""
        if stream_id == 0:
            raise self._connection_error(_PROTOCOL_ERROR, f"{what} on stream 0")
        if self._is_idle(stream_id):
            raise self._connection_error(_PROTOCOL_ERROR, f"{what} on idle stream {stream_id}")
        if stream_id not in self._resets:
            raise self._connection_error(_STREAM_CLOSED, f"{what} on closed stream {stream_id}")

    def _on_stray_data(self, stream_id: int, stream: S | None) -> None:
        if stream is None:
            self._closed_frame(stream_id, "DATA")
        elif stream.recv_state == AWAITING_HEADERS:
            self._stream_error(stream, _PROTOCOL_ERROR, "DATA before the header block")
        else:
            self._stream_error(stream, _STREAM_CLOSED, "DATA after the end of the stream")

    def _on_header_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise self._connection_error(_PROTOCOL_ERROR, "a header frame on stream 0")
        if kind == HEADERS and flags & _BLOCK_FLAGS == END_HEADERS:
            # The common frame, a whole unpadded block: nothing to assemble.
            if len(payload) > self._max_header_block:
                raise self._connection_error(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
            self._on_header_block(stream_id, bool(flags & END_STREAM), payload)
            return
        if kind == HEADERS:
            start, end = 0, len(payload)
            if flags & PADDED:
                if not end:
                    raise self._connection_error(
                        _FRAME_SIZE_ERROR, "padded HEADERS without its length"
                    )
                pad = payload[0]
                start = 1
                room = end - 1 - (5 if flags & PRIORITY_FLAG else 0)
                if pad > room or (pad and pad >= end - 1):
                    raise self._connection_error(
                        _PROTOCOL_ERROR, "HEADERS padding exceeds the frame"
                    )
                end -= pad
            if flags & PRIORITY_FLAG:
                if end - start < 5:
                    raise self._connection_error(
                        _FRAME_SIZE_ERROR, "HEADERS too short for its priority"
                    )
                if U32.unpack_from(payload, start)[0] & MAX_STREAM_ID == stream_id:
                    raise self._connection_error(_PROTOCOL_ERROR, "a stream depends on itself")
                start += 5
            self._header_block = bytearray(payload[start:end])
            self._header_stream = stream_id
            self._header_end = bool(flags & END_STREAM)
            self._header_frames = 1
        elif self._header_block is None or stream_id != self._header_stream:
            raise self._connection_error(_PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        else:
            self._header_block += payload
            self._header_frames += 1
        if len(self._header_block) > self._max_header_block:
            raise self._connection_error(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if self._header_frames > MAX_HEADER_FRAMES:
            raise self._connection_error(
                ErrorCode.ENHANCE_YOUR_CALM, "header block in too many frames"
            )
        if not flags & END_HEADERS:
            return
        block, self._header_block = bytes(self._header_block), None
        self._on_header_block(self._header_stream, self._header_end, block)

    def _on_header_block(self, stream_id: int, end_stream: bool, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)
        except hpack.HPACKError as error:
            raise self._connection_error(
                ErrorCode.COMPRESSION_ERROR, f"undecodable headers: {error}"
            ) from None
        stream = self.streams.get(stream_id)
        if stream is not None:
            state = stream.recv_state
            if state == REMOTE_CLOSED:
                self._stream_error(stream, _STREAM_CLOSED, "HEADERS after the end of the stream")
                return
            if state == RECEIVING:
                if not end_stream:
                    self._stream_error(stream, _PROTOCOL_ERROR, "trailers without END_STREAM")
                    return
                for name, _ in headers:
                    if name[:1] == ":":
                        self._stream_error(stream, _PROTOCOL_ERROR, "trailers with a pseudo-header")
                        return
            else:
                for name, value in headers:
                    if name == ":status":
                        if value[:1] == "1":
                            # Informational: the final response is still to come.
                            if end_stream:
                                self._stream_error(
                                    stream, _PROTOCOL_ERROR, "a 1xx response ends the stream"
                                )
                                return
                            break
                        stream.recv_state = RECEIVING
                        break
                else:
                    stream.recv_state = RECEIVING
            if end_stream:
                stream.recv_state = REMOTE_CLOSED
            stream.on_headers(headers, end_stream)
            return
        if not self.client and stream_id & 1 and stream_id > self.last_peer_stream:
            self.last_peer_stream = stream_id
            self.on_new_stream(stream_id, headers, end_stream)
            return
        self._closed_frame(stream_id, "HEADERS")

    def _on_control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        size = len(payload)
        if kind == SETTINGS:
            self._on_settings_frame(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            if size != 4:
                raise self._connection_error(_FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
            increment = U32.unpack(payload)[0] & MAX_WINDOW
            if stream_id == 0:
                if not increment:
                    raise self._connection_error(
                        _PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection"
                    )
                self.send_window += increment
                if self.send_window > MAX_WINDOW:
                    raise self._connection_error(
                        _FLOW_CONTROL_ERROR, "connection window above 2^31-1"
                    )
            else:
                stream = self.streams.get(stream_id)
                if stream is None:
                    if self._is_idle(stream_id):
                        raise self._connection_error(
                            _PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream"
                        )
                    if not increment:
                        # No stream left to reset; a zero increment is never in flight
                        # from a working peer.
                        raise self._connection_error(
                            _PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on a closed stream"
                        )
                    return
                if not increment:
                    self._stream_error(stream, _PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
                    return
                stream.send_window += increment
                if stream.send_window > MAX_WINDOW:
                    self._stream_error(stream, _FLOW_CONTROL_ERROR, "stream window above 2^31-1")
                    return
            if self._blocked:
                self._drain()
        elif kind == RST_STREAM:
            if size != 4:
                raise self._connection_error(_FRAME_SIZE_ERROR, "RST_STREAM of a wrong size")
            if stream_id == 0:
                raise self._connection_error(_PROTOCOL_ERROR, "RST_STREAM on stream 0")
            stream = self.streams.pop(stream_id, None)
            if stream is None:
                if self._is_idle(stream_id):
                    raise self._connection_error(_PROTOCOL_ERROR, "RST_STREAM on an idle stream")
                return
            # Not remembered: a peer that reset a stream sends nothing more on it.
            stream.pending = None
            stream.on_reset(U32.unpack(payload)[0])
        elif kind == PING:
            self._on_ping_frame(flags, stream_id, payload)
        elif kind == GOAWAY:
            self._on_goaway_frame(stream_id, payload)
        elif kind == PRIORITY:
            self._on_priority_frame(stream_id, payload)
        elif kind == PUSH_PROMISE:
            raise self._connection_error(
                _PROTOCOL_ERROR, "PUSH_PROMISE, which this end never allows"
            )
        # Frames of unknown types are ignored (RFC 9113 section 5.5).

    def _on_settings_frame(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise self._connection_error(_PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise self._connection_error(_FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise self._connection_error(_FRAME_SIZE_ERROR, "SETTINGS of an odd size")
        self._apply_settings(payload)
        self.out.append(frame(SETTINGS, ACK, 0))
        if self._blocked:
            self._drain()
        self.on_settings()

    def _on_ping_frame(self, flags: int, stream_id: int, payload: bytes) -> None:
        if len(payload) != 8:
            raise self._connection_error(_FRAME_SIZE_ERROR, "PING of a wrong size")
        if stream_id:
            raise self._connection_error(_PROTOCOL_ERROR, "PING on a stream")
        if flags & ACK:
            self.on_ping_ack(payload)
        else:
            self.out.append(frame(PING, ACK, 0, payload))

    def _on_goaway_frame(self, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise self._connection_error(_PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise self._connection_error(_FRAME_SIZE_ERROR, "GOAWAY too short")
        last, code = GOAWAY_HEAD.unpack_from(payload)
        self.on_goaway(last & MAX_STREAM_ID, code, payload[8:])

    def _on_priority_frame(self, stream_id: int, payload: bytes) -> None:
        """PRIORITY is checked and otherwise ignored: RFC 9113 deprecates the scheme."""
        if stream_id == 0:
            raise self._connection_error(_PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise self._connection_error(_FRAME_SIZE_ERROR, "PRIORITY of a wrong size")
        if U32.unpack_from(payload)[0] & MAX_STREAM_ID == stream_id:
            raise self._connection_error(_PROTOCOL_ERROR, "a stream depends on itself")

    def _apply_settings(self, payload: bytes) -> None:
        for at in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, at)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise self._connection_error(
                        _FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1"
                    )
                change = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += change
                    if stream.send_window > MAX_WINDOW:
                        raise self._connection_error(
                            _FLOW_CONTROL_ERROR, "a stream window above 2^31-1"
                        )
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= LARGEST_MAX_FRAME:
                    raise self._connection_error(
                        _PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE of {value}"
                    )
                self.peer_max_frame = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == SETTINGS_ENABLE_PUSH and (value > 1 or (value and self.client)):
                raise self._connection_error(_PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH of {value}")


__all__ = ["MAX_HEADER_BLOCK", "MAX_HEADER_FRAMES", "H2Connection", "H2Stream"]
