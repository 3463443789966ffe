"""The server end of one HTTP/2 connection carrying gRPC calls, for :mod:`rankgate.mocker.h2server`.

What the server role adds to the gateway's sans-IO HTTP/2 core (frames, settings, windows,
header blocks, limits): responses as HPACK literals that never touch the peer's table,
WINDOW_UPDATE for request bytes received, RST_STREAM from the client as cancellation, GOAWAY on
stop, ``grpc-timeout`` deadlines, gzip/deflate request messages, REFUSED_STREAM past its
concurrency bound, and what every call produced during one loop iteration written at once.
A call ends with the status code and message grpc.aio would send: a returned
``NotImplementedError`` from a generated base class reads ``Unexpected <class
'NotImplementedError'>: ...`` as it does there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import logging
import socket
import struct
import time
import zlib
from collections.abc import Iterable
from typing import Any, Protocol, cast
from urllib.parse import quote

import grpc

from rankgate.mocker.servicer_context import Aborted, Method, ServicerContext
from rankgate.wire.grpc_frame import MESSAGE_HEAD
from rankgate.wire.h2.connection import H2Connection, H2Stream
from rankgate.wire.h2.errors import H2ConnectionError, H2StreamError
from rankgate.wire.h2.frames import (
    DATA,
    END_HEADERS,
    HEADERS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    ErrorCode,
    frame_head,
)
from rankgate.wire.h2.headers import hpack_int, hpack_str, literal

log = logging.getLogger(__name__)

MAX_CONCURRENT_STREAMS = 4096
# What a client may send on one stream before we grant more, and on the whole connection.
RECV_STREAM_WINDOW = 1 << 20
RECV_CONNECTION_WINDOW = 16 << 20
MAX_HEADER_BLOCK = 64 << 10

# A DATA frame's head followed by the head of the one message it carries.
_DATA_HEAD = struct.Struct(">HBBBLBL")

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# gRPC percent-encodes grpc-message bytes outside printable ASCII, and '%' itself.
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


# ---------------------------------------------------------------- HPACK literals (responses)


# :status 200 is static entry 8; content-type's name is static entry 31.
_RESPONSE_HEADERS = (
    b"\x88"
    + hpack_int(31, 4)
    + hpack_str(b"application/grpc")
    + literal("grpc-accept-encoding", "identity,deflate,gzip")
)
_OK_TRAILERS = literal("grpc-status", "0")


def status_block(
    code: grpc.StatusCode, details: str, trailing: Iterable[tuple[str, str | bytes]] = ()
) -> bytes:
    """The trailer fields that carry a call's status, as grpc.aio words them."""
    if code is grpc.StatusCode.OK and not details and not trailing:
        return _OK_TRAILERS
    block = bytearray(literal("grpc-status", str(code.value[0])))
    if details:
        block += literal("grpc-message", quote(details, safe=_MESSAGE_SAFE))
    for key, value in trailing:
        if isinstance(value, bytes):
            value = base64.b64encode(value).rstrip(b"=")
        block += literal(key.lower(), value)
    return bytes(block)


# ---------------------------------------------------------------- the method table


class CallServer(Protocol):
    """The server a connection serves calls for (:class:`rankgate.mocker.h2server.H2Server`)."""

    max_message: int
    max_concurrent_streams: int
    connections: set[Any]

    def resolve(self, path: str) -> Method | None: ...

    def wake_stop(self) -> None: ...


class Stream(H2Stream):
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
        "pending_trailers",
        "recv_credit",
        "reset",
        "started",
        "task",
        "timer",
        "waiter",
    )

    def __init__(self, conn: Connection, path: str, method: Method) -> None:
        super().__init__()
        self.conn = conn
        self.path = path
        self.method = method
        self.body = bytearray()
        self.recv_credit = 0
        self.encoding = ""
        self.started = False
        self.headers_sent = False
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

    # -- hooks of the core

    def on_data(self, data: bytes, flow: int, end_stream: bool) -> None:
        self.conn.on_request_data(self, data, flow, end_stream)

    def on_headers(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        # Trailers from the client: only their end of stream matters.
        if end_stream:
            self.conn.on_remote_end(self)

    def on_reset(self, code: int) -> None:
        self.conn.drop(self)

    def on_stream_error(self, error: H2StreamError) -> None:
        log.warning("HTTP/2 stream error from %s: %s", self.conn.peer, error.message)
        self.conn.drop(self)

    def on_drained(self) -> None:
        trailers = self.pending_trailers
        if trailers is not None:
            self.pending_trailers = None
            self.conn.send_headers(self.stream_id, trailers, True)
            self.conn.close_call(self)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


# ---------------------------------------------------------------- the connection


class Connection(H2Connection[Stream], asyncio.Protocol):
    """The server end of one HTTP/2 connection."""

    def __init__(self, server: CallServer) -> None:
        super().__init__(
            client=False,
            settings=(
                (SETTINGS_MAX_CONCURRENT_STREAMS, server.max_concurrent_streams),
                (SETTINGS_INITIAL_WINDOW_SIZE, RECV_STREAM_WINDOW),
            ),
            connection_window=RECV_CONNECTION_WINDOW,
            connection_credit_step=RECV_CONNECTION_WINDOW // 2,
            max_header_block=MAX_HEADER_BLOCK,
        )
        self.server = server
        self.peer = ""
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._flush_pending = False
        self._paused = False
        self._resumed: asyncio.Future[None] | None = None
        self._going_away = False

    @property
    def active(self) -> int:
        return len(self.streams)

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
        self.initiate()
        self._flush()
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._transport = None
        self.out.clear()
        self.server.connections.discard(self)
        streams = list(self.streams.values())
        self.streams.clear()
        self._blocked.clear()
        for stream in streams:
            self.drop(stream)
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
        try:
            self.receive(data)
        except H2ConnectionError as error:
            log.warning("HTTP/2 connection error from %s: %s", self.peer or "a client", error)
            transport = self._transport
            if transport is not None:
                self._flush()
                transport.close()
            self.connection_lost(None)
            return
        self._flush()

    # -- receiving

    def on_new_stream(self, stream_id: int, headers: list[tuple[str, str]], end: bool) -> None:
        if self._going_away or len(self.streams) >= self.server.max_concurrent_streams:
            self.refuse(stream_id, ErrorCode.REFUSED_STREAM)
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
            self.send_headers(stream_id, block, True)
            self._refuse_body(stream_id, end)
            return
        method = self.server.resolve(path)
        if method is None:
            block = _RESPONSE_HEADERS + status_block(
                grpc.StatusCode.UNIMPLEMENTED, "Method not found!"
            )
            self.send_headers(stream_id, block, True)
            self._refuse_body(stream_id, end)
            return
        stream = Stream(self, path, method)
        stream.context = ServicerContext(stream, headers)
        if encoding and encoding != "identity":
            stream.encoding = encoding
        self.add_stream(stream, stream_id, end)
        if timeout:
            self._arm_deadline(stream, timeout)
        if end:
            self.on_remote_end(stream)

    def _refuse_body(self, stream_id: int, ended: bool) -> None:
        if not ended:
            self.refuse(stream_id, ErrorCode.NO_ERROR)

    def _arm_deadline(self, stream: Stream, timeout: str) -> None:
        unit = _TIMEOUT_UNITS.get(timeout[-1:])
        digits = timeout[:-1]
        if unit is None or not (digits.isascii() and digits.isdigit()):
            return
        seconds = int(digits) * unit
        stream.deadline = time.monotonic() + seconds
        stream.timer = self._loop.call_later(seconds, self._expire, stream)

    def on_request_data(self, stream: Stream, data: bytes, flow: int, end_stream: bool) -> None:
        stream.recv_credit += flow
        if stream.started:
            if data:
                self._fail(stream, grpc.StatusCode.INTERNAL, "too many request messages")
                return
        else:
            body = stream.body
            body += data
            if len(body) >= 5:
                length = MESSAGE_HEAD.unpack_from(body)[1]
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
        if end_stream:
            self.on_remote_end(stream)
        elif stream.recv_credit >= RECV_STREAM_WINDOW // 2 and not stream.ended:
            self.grant(stream, stream.recv_credit)
            stream.recv_credit = 0

    def on_remote_end(self, stream: Stream) -> None:
        if not stream.started and not stream.ended:
            self._fail(stream, grpc.StatusCode.INTERNAL, "the request carried no complete message")

    def _start(self, stream: Stream) -> None:
        stream.started = True
        body = bytes(stream.body)
        stream.body = bytearray()
        stream.task = self._loop.create_task(self._serve(stream, body))

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
            # The context holds its stream: a cycle otherwise, left to the cyclic collector.
            stream.context = None

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
        if not stream.headers_sent:
            stream.headers_sent = True
            self.out.append(
                frame_head(HEADERS, END_HEADERS, stream.stream_id, len(_RESPONSE_HEADERS))
                + _RESPONSE_HEADERS
            )
        size = len(payload) + 5
        if self.reserve(stream, size):
            out = self.out
            out.append(
                _DATA_HEAD.pack(size >> 8, size & 0xFF, DATA, 0, stream.stream_id, 0, size - 5)
            )
            out.append(payload)
            sent = True
        else:
            sent = self.send_data(stream, payload, False, MESSAGE_HEAD.pack(0, size - 5))
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)
        return not sent

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
            self.send_headers(stream.stream_id, _RESPONSE_HEADERS + block, True)
        elif stream.pending:
            stream.pending_trailers = block
            return
        else:
            self.send_headers(stream.stream_id, block, True)
        self.close_call(stream)
        self._schedule_flush()

    def _fail(self, stream: Stream, code: grpc.StatusCode, details: str) -> None:
        """End a call the client got wrong; its handler, if running, is cancelled."""
        if stream.pending:
            # Mid-message: no trailers can follow, only a reset.
            self.reset_stream(stream, ErrorCode.INTERNAL_ERROR)
            self.drop(stream)
        else:
            self._finish(stream, code, details)
            task = stream.task
            if task is not None and not task.done():
                task.cancel()
            if not stream.remote_closed:
                self.refuse(stream.stream_id, ErrorCode.NO_ERROR)
        self.close_call(stream)
        self._schedule_flush()

    def close_call(self, stream: Stream) -> None:
        if self.streams.get(stream.stream_id) is stream:
            self.close_stream(stream)
            if self._going_away and not self.streams:
                self.close_if_idle()
                self.server.wake_stop()

    def drop(self, stream: Stream) -> None:
        """The client is gone (RST_STREAM or lost connection): stop the handler."""
        stream.reset = True
        stream.ended = True
        stream.pending = None
        task = stream.task
        if task is not None and not task.done():
            task.cancel()
        waiter = stream.waiter
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if self._going_away and not self.streams:
            self.server.wake_stop()

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

    def _schedule_flush(self) -> None:
        if not self._flush_pending and self.out:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """One ``transport.write`` for everything queued since the last flush."""
        self._flush_pending = False
        out = self.out
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
        self.send_goaway(ErrorCode.NO_ERROR)
        self._flush()

    def abort_all(self) -> list[asyncio.Task[None]]:
        """Cancel every call still running and close the connection."""
        tasks = [s.task for s in self.streams.values() if s.task is not None]
        transport = self._transport
        if transport is not None:
            self._flush()
            transport.close()
        self.connection_lost(None)
        return tasks

    def close_if_idle(self) -> None:
        if not self.streams and self._transport is not None:
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
