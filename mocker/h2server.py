"""gRPC over HTTP/2, served on the event loop itself: the mock engine's default transport.

Why not grpcio: every message grpc.aio sends crosses threads (the servicer's task hands it to
C-core, whose threads write the socket and report back through a poller that wakes the loop),
which costs 60-80 µs of CPU per streamed message here, more than the engine spends making it.
This server parses frames in ``data_received``, runs each call as one task, and writes what
every call produced during one loop iteration with a single ``transport.write``.

It serves unary-request methods (unary and server-streaming responses) registered the way
generated ``add_*Servicer_to_server`` functions register them, so the same servicers run on
either server. Their context offers what grpc.aio's offers and servicers here use
(``invocation_metadata``, ``abort``, ``set_code``/``set_details``, ``write``, ``cancelled``,
``done``, ``add_done_callback``, ``peer``, ``time_remaining``), and a call ends with the
status code and message grpc.aio would send: a returned ``NotImplementedError`` from a
generated base class reads ``Unexpected <class 'NotImplementedError'>: ...`` as it does there.

HTTP/2 (RFC 9113) as a gRPC server needs it: the preface and SETTINGS exchange, HPACK with the
dynamic table on requests (responses are literals that never touch the peer's table),
requests split over DATA frames and CONTINUATION, the peer's flow-control windows and frame
size on everything sent, WINDOW_UPDATE for what was received, RST_STREAM from the client as
cancellation, PING, GOAWAY on stop, ``grpc-timeout`` deadlines, gzip/deflate request
messages, and an advertised bound on concurrent streams.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import inspect
import logging
import socket
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

import grpc
import hpack

from sidecar.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    WINDOW_UPDATE,
    HeaderDecoder,
    hpack_int,
    hpack_str,
)

log = logging.getLogger(__name__)

MAX_CONCURRENT_STREAMS = 4096
# What a client may send on one stream before we grant more, and on the whole connection.
RECV_STREAM_WINDOW = 1 << 20
RECV_CONNECTION_WINDOW = 16 << 20
MAX_HEADER_BLOCK = 64 << 10

NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
FRAME_SIZE_ERROR = 0x6
COMPRESSION_ERROR = 0x9

_FRAME = struct.Struct(">HBBBL")
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_MESSAGE_HEAD = struct.Struct(">BL")
# A DATA frame's head followed by the head of the one message it carries.
_DATA_HEAD = struct.Struct(">HBBBLBL")

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# Request headers that are transport, not metadata (grpc.aio leaves them out too).
_NOT_METADATA = frozenset(
    ("te", "content-type", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding")
)
# gRPC percent-encodes grpc-message bytes outside printable ASCII, and '%' itself.
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


# ---------------------------------------------------------------- HPACK literals (responses)


def _literal(name: str, value: str | bytes) -> bytes:
    """A literal header field without indexing, new name (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_str(name) + hpack_str(value)


# :status 200 is static entry 8; content-type's name is static entry 31.
_RESPONSE_HEADERS = (
    b"\x88"
    + hpack_int(31, 4)
    + hpack_str(b"application/grpc")
    + _literal("grpc-accept-encoding", "identity,deflate,gzip")
)
_OK_TRAILERS = _literal("grpc-status", "0")


def status_block(
    code: grpc.StatusCode, details: str, trailing: Iterable[tuple[str, str | bytes]] = ()
) -> bytes:
    """The trailer fields that carry a call's status, as grpc.aio words them."""
    if code is grpc.StatusCode.OK and not details and not trailing:
        return _OK_TRAILERS
    block = bytearray(_literal("grpc-status", str(code.value[0])))
    if details:
        block += _literal("grpc-message", quote(details, safe=_MESSAGE_SAFE))
    for key, value in trailing:
        if isinstance(value, bytes):
            value = base64.b64encode(value).rstrip(b"=")
        block += _literal(key.lower(), value)
    return bytes(block)


def _frame_head(kind: int, flags: int, stream_id: int, size: int) -> bytes:
    return _FRAME.pack(size >> 8, size & 0xFF, kind, flags, stream_id)


# ---------------------------------------------------------------- the method table


@dataclass(frozen=True, slots=True)
class Method:
    """One servable RPC: its handler and how its messages cross the wire."""

    handler: Callable[..., Any]
    parse: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]
    streaming: bool
    # A streaming handler that yields its responses (else it awaits ``context.write``).
    generator: bool = False

    @classmethod
    def from_handler(cls, handler: Any) -> Method | None:
        """From a ``grpc.RpcMethodHandler``; None for client-streaming methods."""
        if handler.request_streaming:
            return None
        parse, serialize = handler.request_deserializer, handler.response_serializer
        if handler.response_streaming:
            function = handler.unary_stream
            return cls(function, parse, serialize, True, inspect.isasyncgenfunction(function))
        return cls(handler.unary_unary, parse, serialize, False)


class _CallDetails:
    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata: tuple[tuple[str, str], ...] = ()


class Aborted(Exception):
    """Raised by :meth:`ServicerContext.abort`; ends the call with the recorded status."""


# ---------------------------------------------------------------- one call


class ServicerContext:
    """What a servicer sees of its call, shaped like grpc.aio's ``ServicerContext``."""

    __slots__ = (
        "_callbacks",
        "_code",
        "_details",
        "_headers",
        "_stream",
        "_trailing",
    )

    def __init__(self, stream: Stream, headers: list[tuple[str, str]]) -> None:
        self._stream = stream
        self._headers = headers
        self._code = grpc.StatusCode.OK
        self._details = ""
        self._trailing: tuple[tuple[str, str | bytes], ...] = ()
        self._callbacks: list[Callable[[ServicerContext], object]] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        metadata: list[tuple[str, str | bytes]] = []
        for name, value in self._headers:
            if name[0] == ":" or name in _NOT_METADATA:
                continue
            if name.endswith("-bin"):
                try:
                    metadata.append((name, base64.b64decode(value + "=" * (-len(value) % 4))))
                except binascii.Error:
                    continue
            else:
                metadata.append((name, value))
        return tuple(metadata)

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        if code is grpc.StatusCode.OK:
            raise ValueError("abort() needs a status code other than OK")
        self._code = code
        if details or not self._details:
            self._details = details
        if trailing_metadata:
            self._trailing = trailing_metadata
        raise Aborted(details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self._trailing = tuple(metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    async def write(self, message: Any) -> None:
        """Send one response message (server-streaming handlers that do not ``yield``)."""
        stream = self._stream
        if stream.ended:
            raise asyncio.CancelledError()
        await stream.conn.send_message(stream, stream.method.serialize(message))

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        # Response headers are fixed; a servicer here never sends its own.
        del metadata

    def cancelled(self) -> bool:
        return self._stream.reset

    def done(self) -> bool:
        return self._stream.ended

    def add_done_callback(self, callback: Callable[[ServicerContext], object]) -> None:
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def peer(self) -> str:
        return self._stream.conn.peer

    def time_remaining(self) -> float | None:
        deadline = self._stream.deadline
        if deadline is None:
            return None
        return max(0.0, deadline - time.monotonic())

    def _run_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:
                log.exception("done callback of %s failed", self._stream.path)


class Stream:
    """The server's state of one HTTP/2 stream carrying one call."""

    __slots__ = (
        "body",
        "conn",
        "context",
        "deadline",
        "encoding",
        "ended",
        "expired",
        "headers_sent",
        "method",
        "path",
        "pending",
        "pending_trailers",
        "recv_credit",
        "remote_closed",
        "reset",
        "send_window",
        "started",
        "stream_id",
        "task",
        "timer",
        "waiter",
    )

    def __init__(self, conn: Connection, stream_id: int, path: str, method: Method) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.path = path
        self.method = method
        self.send_window = conn.peer_initial_window
        self.body = bytearray()
        self.recv_credit = 0
        self.encoding = ""
        self.started = False
        self.remote_closed = False
        self.headers_sent = False
        self.pending = bytearray()
        self.pending_trailers: bytes | None = None
        # Set once the call's status is on its way (or the stream is gone).
        self.ended = False
        self.reset = False
        self.expired = False
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.context: ServicerContext | None = None


# ---------------------------------------------------------------- the connection


class Connection(asyncio.Protocol):
    """The server end of one HTTP/2 connection."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.peer = ""
        self.peer_initial_window = DEFAULT_WINDOW
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._buffer = b""
        self._preface = False
        self._decoder = HeaderDecoder()
        self._streams: dict[int, Stream] = {}
        self._last_stream = 0
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._send_window = DEFAULT_WINDOW
        self._recv_credit = 0
        self._blocked: deque[Stream] = deque()
        self._out: list[bytes] = []
        self._flush_pending = False
        self._paused = False
        self._resumed: asyncio.Future[None] | None = None
        self._header_block: bytearray | None = None
        self._header_stream = 0
        self._header_flags = 0
        self._going_away = False

    @property
    def active(self) -> int:
        return len(self._streams)

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and sock is not None and sock.family == socket.AF_INET6:
            self.peer = f"ipv6:[{peer[0]}]:{peer[1]}"
        elif isinstance(peer, tuple):
            self.peer = f"ipv4:{peer[0]}:{peer[1]}"
        else:
            self.peer = f"unix:{peer}"
        settings = b"".join(
            _SETTING.pack(key, value)
            for key, value in (
                (SETTINGS_MAX_CONCURRENT_STREAMS, self.server.max_concurrent_streams),
                (SETTINGS_INITIAL_WINDOW_SIZE, RECV_STREAM_WINDOW),
            )
        )
        self._write(_frame_head(SETTINGS, 0, 0, len(settings)) + settings)
        increment = RECV_CONNECTION_WINDOW - DEFAULT_WINDOW
        self._write(_frame_head(WINDOW_UPDATE, 0, 0, 4) + _U32.pack(increment))
        self._flush()
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._out.clear()
        self.server.connections.discard(self)
        streams = list(self._streams.values())
        self._streams.clear()
        self._blocked.clear()
        for stream in streams:
            self._drop(stream)
        resumed, self._resumed = self._resumed, None
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        resumed, self._resumed = self._resumed, None
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        at = 0
        if not self._preface:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    self._connection_error(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                    return
                self._buffer = data
                return
            if not data.startswith(PREFACE):
                self._connection_error(PROTOCOL_ERROR, "not an HTTP/2 client preface")
                return
            self._preface = True
            at = len(PREFACE)
        size = len(data)
        streams = self._streams
        while size - at >= 9:
            hi, lo, kind, flags, stream_id = _FRAME.unpack_from(data, at)
            length = (hi << 8) | lo
            if length > DEFAULT_MAX_FRAME:
                self._connection_error(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                return
            end = at + 9 + length
            if end > size:
                break
            stream_id &= MAX_WINDOW
            if self._header_block is not None and kind != CONTINUATION:
                self._connection_error(PROTOCOL_ERROR, "a header block was interrupted")
                return
            if kind == DATA:
                self._recv_credit += length
                stream = streams.get(stream_id)
                if stream is not None and not stream.remote_closed:
                    if flags & PADDED:
                        self._on_data(stream, data[at + 10 : end - data[at + 9]], length, flags)
                    else:
                        self._on_data(stream, data[at + 9 : end], length, flags)
                elif stream_id == 0:
                    self._connection_error(PROTOCOL_ERROR, "DATA on stream 0")
                    return
                if self._recv_credit >= RECV_CONNECTION_WINDOW // 2:
                    self._write(_frame_head(WINDOW_UPDATE, 0, 0, 4) + _U32.pack(self._recv_credit))
                    self._recv_credit = 0
            elif kind in (HEADERS, CONTINUATION):
                self._on_header_frame(kind, flags, stream_id, data[at + 9 : end])
            else:
                self._on_control(kind, flags, stream_id, data[at + 9 : end])
            if self._transport is None:
                return
            at = end
        if at < size:
            self._buffer = data[at:]
        self._flush()

    # -- receiving

    def _on_header_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == HEADERS:
            start, end = 0, len(payload)
            if flags & PADDED:
                start = 1
                end -= payload[0]
            if flags & PRIORITY_FLAG:
                start += 5
            self._header_block = bytearray(payload[start:end])
            self._header_stream = stream_id
            self._header_flags = flags
        elif self._header_block is None or stream_id != self._header_stream:
            self._connection_error(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            return
        else:
            self._header_block += payload
            flags |= self._header_flags & END_STREAM
        if len(self._header_block) > MAX_HEADER_BLOCK:
            self._connection_error(PROTOCOL_ERROR, "header block too large")
            return
        if not flags & END_HEADERS:
            return
        block, self._header_block = bytes(self._header_block), None
        try:
            headers = self._decoder.decode(block)
        except hpack.HPACKError as error:
            self._connection_error(COMPRESSION_ERROR, f"undecodable headers: {error}")
            return
        stream_id = self._header_stream
        end_stream = bool(flags & END_STREAM)
        stream = self._streams.get(stream_id)
        if stream is not None:
            # Trailers from the client: only their end of stream matters.
            if end_stream:
                self._on_remote_end(stream)
            return
        if stream_id <= self._last_stream:
            return
        if not stream_id & 1:
            self._connection_error(PROTOCOL_ERROR, f"client stream id {stream_id} is even")
            return
        self._last_stream = stream_id
        self._on_request(stream_id, headers, end_stream)

    def _on_request(self, stream_id: int, headers: list[tuple[str, str]], end: bool) -> None:
        if self._going_away or len(self._streams) >= self.server.max_concurrent_streams:
            self._write(_frame_head(RST_STREAM, 0, stream_id, 4) + _U32.pack(REFUSED_STREAM))
            return
        path = content_type = timeout = encoding = ""
        for name, value in headers:
            if name == ":path":
                path = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                timeout = value
            elif name == "grpc-encoding":
                encoding = value
        if not content_type.startswith("application/grpc"):
            block = b"\x00" + hpack_str(b":status") + hpack_str(b"415")
            self._send_headers(stream_id, block, END_STREAM)
            self._refuse_body(stream_id, end)
            return
        method = self.server.resolve(path)
        if method is None:
            self._send_headers(
                stream_id,
                _RESPONSE_HEADERS
                + status_block(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"),
                END_STREAM,
            )
            self._refuse_body(stream_id, end)
            return
        stream = Stream(self, stream_id, path, method)
        stream.context = ServicerContext(stream, headers)
        if encoding and encoding != "identity":
            stream.encoding = encoding
        self._streams[stream_id] = stream
        if timeout:
            self._arm_deadline(stream, timeout)
        if end:
            self._on_remote_end(stream)

    def _refuse_body(self, stream_id: int, ended: bool) -> None:
        if not ended:
            self._write(_frame_head(RST_STREAM, 0, stream_id, 4) + _U32.pack(NO_ERROR))

    def _arm_deadline(self, stream: Stream, timeout: str) -> None:
        unit = _TIMEOUT_UNITS.get(timeout[-1:])
        digits = timeout[:-1]
        if unit is None or not digits.isdigit():
            return
        seconds = int(digits) * unit
        stream.deadline = time.monotonic() + seconds
        stream.timer = self._loop.call_later(seconds, self._expire, stream)

    def _on_data(self, stream: Stream, data: bytes, flow: int, flags: int) -> None:
        stream.recv_credit += flow
        if stream.started:
            if data:
                self._fail(stream, grpc.StatusCode.INTERNAL, "too many request messages")
                return
        else:
            body = stream.body
            body += data
            if len(body) >= 5:
                length = _MESSAGE_HEAD.unpack_from(body)[1]
                limit = self.server.max_message
                if length > limit:
                    self._fail(
                        stream,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Received message larger than max ({length} vs. {limit})",
                    )
                    return
                if len(body) > 5 + length:
                    self._fail(stream, grpc.StatusCode.INTERNAL, "too many request messages")
                    return
                if len(body) == 5 + length:
                    self._start(stream)
        if flags & END_STREAM:
            self._on_remote_end(stream)
        elif stream.recv_credit >= RECV_STREAM_WINDOW // 2 and not stream.ended:
            self._write(
                _frame_head(WINDOW_UPDATE, 0, stream.stream_id, 4) + _U32.pack(stream.recv_credit)
            )
            stream.recv_credit = 0

    def _on_remote_end(self, stream: Stream) -> None:
        stream.remote_closed = True
        if not stream.started and not stream.ended:
            self._fail(stream, grpc.StatusCode.INTERNAL, "the request carried no complete message")

    def _start(self, stream: Stream) -> None:
        stream.started = True
        body = bytes(stream.body)
        stream.body = bytearray()
        stream.task = self._loop.create_task(self._serve(stream, body))

    def _on_control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == SETTINGS:
            if not flags & ACK:
                if len(payload) % 6:
                    self._connection_error(FRAME_SIZE_ERROR, "SETTINGS of an odd size")
                    return
                self._apply_settings(payload)
                self._write(_frame_head(SETTINGS, ACK, 0, 0))
        elif kind == WINDOW_UPDATE:
            if len(payload) != 4:
                self._connection_error(FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
                return
            increment = _U32.unpack(payload)[0] & MAX_WINDOW
            if stream_id == 0:
                self._send_window += increment
                if self._send_window > MAX_WINDOW:
                    self._connection_error(FLOW_CONTROL_ERROR, "connection window overflow")
                    return
            else:
                stream = self._streams.get(stream_id)
                if stream is None:
                    return
                stream.send_window += increment
            if self._blocked:
                self._drain()
        elif kind == RST_STREAM:
            stream = self._streams.pop(stream_id, None)
            if stream is not None:
                self._drop(stream)
        elif kind == PING:
            if not flags & ACK and len(payload) == 8:
                self._write(_frame_head(PING, ACK, 0, 8) + payload)
        elif kind == PUSH_PROMISE:
            self._connection_error(PROTOCOL_ERROR, "PUSH_PROMISE from a client")

    def _apply_settings(self, payload: bytes) -> None:
        for at in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, at)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                change = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += change
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self._peer_max_frame = value
        if self._blocked:
            self._drain()

    def _connection_error(self, code: int, what: str) -> None:
        log.warning("HTTP/2 connection error from %s: %s", self.peer or "a client", what)
        transport = self._transport
        if transport is None:
            return
        self._out.clear()
        payload = _U32.pack(self._last_stream) + _U32.pack(code) + what.encode()[:200]
        transport.write(_frame_head(GOAWAY, 0, 0, len(payload)) + payload)
        transport.close()
        self.connection_lost(None)

    # -- running a call

    async def _serve(self, stream: Stream, body: bytes) -> None:
        method = stream.method
        context = stream.context
        assert context is not None
        try:
            payload = body[5:]
            if body[0]:
                try:
                    payload = _decompress(stream.encoding, payload)
                except _Unsupported as error:
                    await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(error))
                except zlib.error as error:
                    await context.abort(grpc.StatusCode.INTERNAL, f"undecompressable: {error}")
            request = method.parse(payload)
            if method.streaming:
                if method.generator:
                    serialize = method.serialize
                    queue = self._queue_message
                    async for response in method.handler(request, context):
                        if queue(stream, serialize(response)) or self._paused:
                            await self._writable(stream)
                else:
                    result = method.handler(request, context)
                    if inspect.isawaitable(result):
                        await result
                    elif result is not None:
                        for response in result:
                            await self.send_message(stream, method.serialize(response))
            else:
                result = method.handler(request, context)
                if inspect.isawaitable(result):
                    result = await result
                if context._code is grpc.StatusCode.OK:
                    self._queue_message(stream, method.serialize(result))
            self._finish(stream, context._code, context._details, context._trailing)
        except Aborted:
            self._finish(stream, context._code, context._details, context._trailing)
        except asyncio.CancelledError:
            if stream.expired:
                self._finish(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except Exception as error:
            log.exception("Unexpected %s raised by servicer method %s", type(error), stream.path)
            code = context._code
            if code is grpc.StatusCode.OK:
                code = grpc.StatusCode.UNKNOWN
            self._finish(stream, code, f"Unexpected {type(error)}: {error}", context._trailing)
        finally:
            if stream.timer is not None:
                stream.timer.cancel()
                stream.timer = None
            if context._callbacks:
                context._run_callbacks()

    async def send_message(self, stream: Stream, payload: bytes) -> None:
        """Send one response message; wait while the peer's windows or the socket are full."""
        if stream.ended:
            raise asyncio.CancelledError()
        if self._queue_message(stream, payload) or self._paused:
            await self._writable(stream)

    async def _writable(self, stream: Stream) -> None:
        """Wait until the stream's queued output is sent and the socket takes more."""
        if stream.pending:
            waiter = stream.waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                stream.waiter = None
        if self._paused and self._transport is not None:
            if self._resumed is None:
                self._resumed = self._loop.create_future()
            await asyncio.shield(self._resumed)

    def _queue_message(self, stream: Stream, payload: bytes) -> bool:
        """Queue a message for the next flush; True when part of it waits for window."""
        if stream.ended:
            return False
        out = self._out
        if not stream.headers_sent:
            stream.headers_sent = True
            out.append(
                _frame_head(HEADERS, END_HEADERS, stream.stream_id, len(_RESPONSE_HEADERS))
                + _RESPONSE_HEADERS
            )
        size = len(payload) + 5
        if (
            not stream.pending
            and size <= stream.send_window
            and size <= self._send_window
            and size <= self._peer_max_frame
        ):
            stream.send_window -= size
            self._send_window -= size
            out.append(
                _DATA_HEAD.pack(size >> 8, size & 0xFF, DATA, 0, stream.stream_id, 0, size - 5)
            )
            out.append(payload)
            self._schedule_flush()
            return False
        if not stream.pending:
            self._blocked.append(stream)
        stream.pending += _MESSAGE_HEAD.pack(0, size - 5)
        stream.pending += payload
        self._drain()
        self._schedule_flush()
        return bool(stream.pending)

    def _drain(self) -> None:
        """Send what the windows allow of every stream that waits for window."""
        blocked = self._blocked
        for _ in range(len(blocked)):
            stream = blocked.popleft()
            if stream.reset:
                continue
            pending = stream.pending
            while pending and self._send_window > 0 and stream.send_window > 0:
                size = min(
                    len(pending), self._peer_max_frame, self._send_window, stream.send_window
                )
                self._out.append(_frame_head(DATA, 0, stream.stream_id, size) + pending[:size])
                del pending[:size]
                self._send_window -= size
                stream.send_window -= size
            if pending:
                blocked.append(stream)
                continue
            trailers = stream.pending_trailers
            if trailers is not None:
                stream.pending_trailers = None
                self._send_headers(stream.stream_id, trailers, END_STREAM)
                self._close_stream(stream)
            waiter = stream.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._schedule_flush()

    def _finish(
        self,
        stream: Stream,
        code: grpc.StatusCode,
        details: str,
        trailing: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        """End the call with its status (trailers, or trailers-only before any message)."""
        if stream.ended:
            return
        stream.ended = True
        block = status_block(code, details, trailing)
        if not stream.headers_sent:
            stream.headers_sent = True
            self._send_headers(stream.stream_id, _RESPONSE_HEADERS + block, END_STREAM)
        elif stream.pending:
            stream.pending_trailers = block
            return
        else:
            self._send_headers(stream.stream_id, block, END_STREAM)
        self._close_stream(stream)

    def _fail(self, stream: Stream, code: grpc.StatusCode, details: str) -> None:
        """End a call the client got wrong; its handler, if running, is cancelled."""
        if stream.pending:
            # Mid-message: no trailers can follow, only a reset.
            self._write(_frame_head(RST_STREAM, 0, stream.stream_id, 4) + _U32.pack(INTERNAL_ERROR))
            self._drop(stream)
        else:
            self._finish(stream, code, details)
            task = stream.task
            if task is not None and not task.done():
                task.cancel()
            if not stream.remote_closed:
                self._write(_frame_head(RST_STREAM, 0, stream.stream_id, 4) + _U32.pack(NO_ERROR))
        self._close_stream(stream)

    def _close_stream(self, stream: Stream) -> None:
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
            if self._going_away and not self._streams:
                self.close_if_idle()
                self.server.wake_stop()

    def _drop(self, stream: Stream) -> None:
        """The client is gone (RST_STREAM or lost connection): stop the handler."""
        stream.reset = True
        stream.ended = True
        stream.pending.clear()
        task = stream.task
        if task is not None and not task.done():
            task.cancel()
        waiter = stream.waiter
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None

    def _expire(self, stream: Stream) -> None:
        stream.timer = None
        if stream.ended:
            return
        stream.expired = True
        task = stream.task
        if task is not None and not task.done():
            task.cancel()
        else:
            self._fail(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    # -- writing

    def _send_headers(self, stream_id: int, block: bytes, flags: int) -> None:
        limit = self._peer_max_frame
        if len(block) <= limit:
            self._write(_frame_head(HEADERS, flags | END_HEADERS, stream_id, len(block)) + block)
            return
        first, rest = block[:limit], block[limit:]
        self._write(_frame_head(HEADERS, flags, stream_id, len(first)) + first)
        while rest:
            chunk, rest = rest[:limit], rest[limit:]
            last = END_HEADERS if not rest else 0
            self._write(_frame_head(CONTINUATION, last, stream_id, len(chunk)) + chunk)

    def _write(self, data: bytes) -> None:
        self._out.append(data)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_pending and self._out:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """One ``transport.write`` for everything queued since the last flush."""
        self._flush_pending = False
        out = self._out
        if not out:
            return
        transport = self._transport
        if transport is None:
            out.clear()
            return
        data = b"".join(out)
        out.clear()
        transport.write(data)

    # -- shutdown

    def go_away(self) -> None:
        """Take no new streams; finish the open ones, then close."""
        self._going_away = True
        payload = _U32.pack(self._last_stream) + _U32.pack(NO_ERROR)
        self._write(_frame_head(GOAWAY, 0, 0, len(payload)) + payload)
        self._flush()

    def abort_all(self) -> list[asyncio.Task[None]]:
        """Cancel every call still running and close the connection."""
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        transport = self._transport
        if transport is not None:
            self._flush()
            transport.close()
        self.connection_lost(None)
        return tasks

    def close_if_idle(self) -> None:
        if not self._streams and self._transport is not None:
            self._flush()
            self._transport.close()


def _decompress(encoding: str, payload: bytes) -> bytes:
    if encoding == "gzip":
        return zlib.decompress(payload, 31)
    if encoding == "deflate":
        return zlib.decompress(payload)
    raise _Unsupported(f"Compression algorithm {encoding or 'unknown'!r} is not supported")


class _Unsupported(Exception):
    pass


# ---------------------------------------------------------------- the server


class H2Server:
    """Serves registered gRPC methods on one listening socket, on the running loop."""

    def __init__(
        self, *, max_message: int, max_concurrent_streams: int = MAX_CONCURRENT_STREAMS
    ) -> None:
        self.max_message = max_message
        self.max_concurrent_streams = max_concurrent_streams
        self.connections: set[Connection] = set()
        self._methods: dict[str, Method] = {}
        self._generic: list[Any] = []
        self._listener: asyncio.Server | None = None
        self._stopping = False
        self._stopped = asyncio.Event()
        self._idle: asyncio.Event | None = None

    # -- registration, as generated ``add_*Servicer_to_server`` functions call it

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        for name, handler in handlers.items():
            method = Method.from_handler(handler)
            if method is not None:
                self._methods[f"/{service}/{name}"] = method

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self._generic.extend(handlers)

    def resolve(self, path: str) -> Method | None:
        method = self._methods.get(path)
        if method is not None or not self._generic:
            return method
        for generic in self._generic:
            handler = generic.service(_CallDetails(path))
            if handler is not None:
                return Method.from_handler(handler)
        return None

    # -- lifecycle

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a port); returns the port bound."""
        loop = asyncio.get_running_loop()
        bind = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        self._listener = await loop.create_server(
            lambda: Connection(self), bind or None, port, reuse_address=True, backlog=1024
        )
        sockets = self._listener.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls (GOAWAY), let running ones finish within ``grace`` seconds (None:
        none), then cancel the rest and close every connection."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if self._listener is not None:
            self._listener.close()
        connections = list(self.connections)
        for conn in connections:
            conn.go_away()
        if grace:
            self._idle = asyncio.Event()
            if any(conn.active for conn in connections):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), grace)
        tasks: list[asyncio.Task[None]] = []
        for conn in list(self.connections):
            tasks.extend(conn.abort_all())
        if tasks:
            await asyncio.wait(tasks)
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._listener.wait_closed(), 1.0)
            self._listener = None
        self._stopped.set()

    def wake_stop(self) -> None:
        """A draining connection finished its last stream."""
        if self._idle is not None and not any(conn.active for conn in self.connections):
            self._idle.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


__all__ = ["Aborted", "H2Server", "Method", "ServicerContext", "status_block"]
