"""One HTTP/2 connection that speaks just enough gRPC for vLLM's two Inference calls.

Why not grpcio here: every message grpc.aio hands out crosses three threads (C-core's event
engine reads the socket, a poller thread drains the completion queue and wakes the event loop
through a socket) and costs 60-80 µs of CPU on this project's machines, more than the whole
per-token budget. This protocol parses frames in the event loop's own ``data_received`` and
hands a message to the waiting reader directly; control-plane RPCs stay on grpcio.

What it implements of HTTP/2 (RFC 9113) and gRPC's HTTP/2 mapping: the preface and SETTINGS
exchange, HEADERS/CONTINUATION with HPACK (the ``hpack`` package decodes; requests are encoded
here as literals), DATA with padding, per-stream and connection flow control in both
directions, RST_STREAM, PING (answered, and sent as keepalive), GOAWAY, peer concurrency
limits, length-prefixed messages, trailers and Trailers-Only responses. Compression is never
offered, so a compressed message is an error.

Receive flow control bounds memory: a stream's window is only re-opened for bytes that are no
longer waiting in its queue of unread messages, so a slow reader stops the engine rather than
filling the gateway.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, cast
from urllib.parse import unquote

import grpc
import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5

CANCEL = 0x8
REFUSED_STREAM = 0x7
ENHANCE_YOUR_CALM = 0xB
INADEQUATE_SECURITY = 0xC

# What each stream may have buffered and unread, and the share of it re-opened at a time.
STREAM_WINDOW = 4 << 20
STREAM_CREDIT_STEP = STREAM_WINDOW // 4
CONNECTION_WINDOW = 64 << 20
CONNECTION_CREDIT_STEP = CONNECTION_WINDOW // 4
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = (1 << 31) - 1
KEEPALIVE_S = 30.0
# How often one request is sent again after the engine refused it unprocessed.
MAX_TRIES = 5
KEEPALIVE_TIMEOUT_S = 10.0
# Messages merged into one read at most: a reader far behind still gets its output in steps.
MAX_MERGED = 32

_FRAME = struct.Struct(">HBBBL")
_SETTING = struct.Struct(">HL")
_U32 = struct.Struct(">L")
_MESSAGE_HEAD = struct.Struct(">BL")

_STATUS_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}
# gRPC's mapping of an HTTP status that is not 200 (doc/http-grpc-status-mapping.md).
_HTTP_STATUS: dict[str, grpc.StatusCode] = {
    "400": grpc.StatusCode.INTERNAL,
    "401": grpc.StatusCode.UNAUTHENTICATED,
    "403": grpc.StatusCode.PERMISSION_DENIED,
    "404": grpc.StatusCode.UNIMPLEMENTED,
    "429": grpc.StatusCode.UNAVAILABLE,
    "502": grpc.StatusCode.UNAVAILABLE,
    "503": grpc.StatusCode.UNAVAILABLE,
    "504": grpc.StatusCode.UNAVAILABLE,
}
_RESET_CODES: dict[int, grpc.StatusCode] = {
    REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE,
    CANCEL: grpc.StatusCode.CANCELLED,
    ENHANCE_YOUR_CALM: grpc.StatusCode.RESOURCE_EXHAUSTED,
    INADEQUATE_SECURITY: grpc.StatusCode.PERMISSION_DENIED,
}

EOF = grpc.aio.EOF


class HeaderDecoder:
    """``hpack``'s decoder, with a memo for blocks that leave the dynamic table unchanged.

    While the table is unchanged the same bytes mean the same headers, and a server answers
    every call with the same few blocks (``:status``/``content-type`` and ``grpc-status: 0``
    once indexed, ``grpc-message`` as a literal that is not indexed); those then cost a dict
    lookup instead of a pure-Python decode. A block that adds to the table or resizes it
    clears the memo, since it changes what the indices mean.
    """

    __slots__ = ("_decoder", "_memo")

    MEMO_SIZE = 64

    def __init__(self) -> None:
        self._decoder = hpack.Decoder()
        self._memo: dict[bytes, list[tuple[str, str]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The block's headers; the list is shared, callers must not change it."""
        known = self._memo.get(block)
        if known is not None:
            return known
        headers = [(str(name), str(value)) for name, value in self._decoder.decode(block)]
        if _keeps_table(block):
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo.clear()
            self._memo[block] = headers
        else:
            self._memo.clear()
        return headers


def _keeps_table(block: bytes) -> bool:
    """Whether no field of the block adds to the dynamic table or resizes it: only indexed
    fields and literals without indexing or never indexed (RFC 7541 section 6)."""
    at, size = 0, len(block)
    try:
        while at < size:
            first = block[at]
            if first & 0x80:
                at = _skip_int(block, at, 7)
            elif first & 0x60:
                return False
            else:
                at = _skip_int(block, at, 4)
                if not first & 0x0F:
                    at = _skip_string(block, at)
                at = _skip_string(block, at)
    except IndexError:
        return False
    return at == size


def _skip_int(block: bytes, at: int, prefix_bits: int) -> int:
    limit = (1 << prefix_bits) - 1
    if block[at] & limit != limit:
        return at + 1
    at += 1
    while block[at] & 0x80:
        at += 1
    return at + 1


def _skip_string(block: bytes, at: int) -> int:
    limit = 0x7F
    length = block[at] & limit
    at += 1
    if length == limit:
        shift = 0
        while True:
            byte = block[at]
            at += 1
            length += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
    return at + length


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return _FRAME.pack(size >> 8, size & 0xFF, kind, flags, stream_id) + payload


def rpc_error(code: grpc.StatusCode, details: str, trailers: Any = None) -> grpc.aio.AioRpcError:
    metadata = grpc.aio.Metadata(*(trailers or ()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), metadata, details)


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.UNAVAILABLE, details)


# ---------------------------------------------------------------- HPACK literals


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a ``prefix_bits`` prefix, high bits from ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_str(text: str | bytes) -> bytes:
    """An HPACK string literal, never Huffman-coded (RFC 7541 5.2)."""
    raw = text.encode() if isinstance(text, str) else text
    return hpack_int(len(raw), 7) + raw


def request_headers(
    scheme: str, authority: str, path: str, metadata: tuple[tuple[str, str], ...] = ()
) -> bytes:
    """The header block of a gRPC request, as literals that never touch the peer's table.

    Built once per (path, metadata) by the caller: a request then costs no encoding at all.
    """
    block = bytearray(b"\x83")  # :method POST (static table 3)
    block += b"\x87" if scheme == "https" else b"\x86"  # :scheme (static 7 / 6)
    block += hpack_int(4, 4) + hpack_str(path)  # :path, name from static 4
    block += hpack_int(1, 4) + hpack_str(authority)  # :authority, static 1
    block += hpack_int(31, 4) + hpack_str("application/grpc")  # content-type, static 31
    block += hpack_int(58, 4) + hpack_str("rankgate")  # user-agent, static 58
    for name, value in (("te", "trailers"), *metadata):
        block += b"\x00" + hpack_str(name.lower()) + hpack_str(value)
    return bytes(block)


def grpc_message(payload: bytes) -> bytes:
    """One uncompressed length-prefixed gRPC message."""
    return _MESSAGE_HEAD.pack(0, len(payload)) + payload


# ---------------------------------------------------------------- calls


class Call:
    """One RPC on a connection: its request is sent at once, its replies queue up here.

    ``read()`` returns the next message (parsed by ``parse``), ``EOF`` after an OK status, or
    raises ``grpc.aio.AioRpcError``; once ``cancel()`` ran it raises ``CancelledError``, as
    grpc.aio's calls do.
    """

    __slots__ = (
        "_cancelled",
        "_conn",
        "_credit",
        "_ended",
        "_error",
        "_got_headers",
        "_held",
        "_merge",
        "_messages",
        "_need",
        "_out",
        "_parse",
        "_partial",
        "_partial_size",
        "_pending",
        "_request",
        "_tries",
        "_waiter",
        "send_window",
        "stream_id",
    )

    def __init__(
        self,
        parse: Callable[[bytes], Any],
        merge: Callable[[Any, list[Any]], bool] | None = None,
    ) -> None:
        self._parse = parse
        # Appends later messages to an earlier one when that loses nothing (True), so a
        # reader that fell behind takes every message already waiting in one go.
        self._merge = merge
        self._pending: deque[Any] = deque()
        self._conn: Connection | None = None
        self.stream_id = 0
        self.send_window = DEFAULT_WINDOW
        self._out = b""
        self._messages: deque[bytes] = deque()
        self._partial: list[bytes] = []
        self._partial_size = 0
        self._need = 5
        self._held = 0
        self._credit = 0
        self._waiter: asyncio.Future[None] | None = None
        self._got_headers = False
        # Set once the call is over: None while running, True after an OK status.
        self._ended: bool | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        # The request as sent, kept until the engine answers: a refused stream is resent.
        self._request: tuple[bytes, bytes] | None = None
        self._tries = 0

    # -- consumer side

    async def read(self) -> Any:
        """The next message, or ``EOF`` once the call ended cleanly (grpc.aio's ``read``)."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return EOF

    def _next(self) -> Any:
        """The next message, with the messages already waiting behind it merged in when
        ``merge`` accepts them all; None when nothing is waiting."""
        pending = self._pending
        if pending:
            # Left whole by a merge that declined them: handed out one by one, in order.
            return pending.popleft()
        messages = self._messages
        if not messages:
            return None
        message = self._take(messages)
        merge = self._merge
        if merge is not None and messages:
            take = self._take
            batch = [take(messages) for _ in range(min(len(messages), MAX_MERGED))]
            if not merge(message, batch):
                pending.extend(batch)
        if self._credit - self._held >= STREAM_CREDIT_STEP:
            self._maybe_credit()
        return message

    def _take(self, messages: deque[bytes]) -> Any:
        data = messages.popleft()
        self._held -= len(data) + 5
        return self._parse(data)

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Any:
        while True:
            message = self._next()
            if message is not None:
                return message
            if self._ended is not None:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def cancel(self) -> bool:
        """Drop the call: RST_STREAM(CANCEL) to the engine, CancelledError to the reader."""
        if self._ended is not None:
            return False
        self._cancelled = True
        self._messages.clear()
        self._pending.clear()
        self._finish(asyncio.CancelledError())
        conn = self._conn
        if conn is not None:
            conn.reset(self)
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._ended is not None

    # -- connection side

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self, error: BaseException | None) -> None:
        if self._ended is not None:
            return
        self._ended = error is None
        self._error = error
        self._wake()

    def on_data(self, data: bytes, flow: int) -> None:
        """``data`` without padding; ``flow`` the frame's size as flow control counts it."""
        self._credit += flow
        if self._ended is not None:
            return
        if self._partial:
            # Chunks of a message that is not complete yet are joined once, when it is.
            self._partial.append(data)
            self._partial_size += len(data)
            if self._partial_size < self._need:
                self._maybe_credit()
                return
            data = b"".join(self._partial)
            self._partial = []
        size = len(data)
        at = 0
        queued = self._messages
        limit = self._conn.max_message if self._conn is not None else 0
        while size - at >= 5:
            compressed, length = _MESSAGE_HEAD.unpack_from(data, at)
            if compressed:
                self.fail(grpc.StatusCode.INTERNAL, "the engine sent a compressed message")
                return
            if length > limit:
                self.fail(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"engine message of {length} bytes exceeds {limit}",
                )
                return
            end = at + 5 + length
            if end > size:
                self._need = 5 + length
                break
            queued.append(data[at + 5 : end])
            self._held += length + 5
            at = end
        else:
            self._need = 5
        if at < size:
            self._partial = [data[at:]]
            self._partial_size = size - at
        if self._credit - self._held >= STREAM_CREDIT_STEP:
            self._maybe_credit()
        if queued:
            self._wake()

    def _maybe_credit(self) -> None:
        grant = self._credit - self._held
        if grant >= STREAM_CREDIT_STEP and self._ended is None and self._conn is not None:
            self._credit -= grant
            self._conn.write(frame(WINDOW_UPDATE, 0, self.stream_id, _U32.pack(grant)))

    def on_headers(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        if self._ended is not None:
            return
        if not self._got_headers:
            self._got_headers = True
            self._request = None
            status = next((v for k, v in headers if k == ":status"), "")
            if status != "200":
                code = _HTTP_STATUS.get(status, grpc.StatusCode.UNKNOWN)
                self.fail(code, f"the engine answered HTTP status {status or 'none'}")
                return
            if not end_stream:
                return
        elif not end_stream:
            self.fail(grpc.StatusCode.INTERNAL, "the engine sent headers after its trailers")
            return
        self._on_trailers(headers)

    def _on_trailers(self, trailers: list[tuple[str, str]]) -> None:
        status: str | None = None
        details = ""
        for name, value in trailers:
            if name == "grpc-status":
                status = value
            elif name == "grpc-message":
                details = unquote(value)
        if status is None:
            self.fail(grpc.StatusCode.INTERNAL, "the engine ended the call without a status")
            return
        code = _STATUS_CODES.get(int(status) if status.isdigit() else -1, grpc.StatusCode.UNKNOWN)
        if code is not grpc.StatusCode.OK:
            pairs = [(k, v) for k, v in trailers if not k.startswith(":") and k != "grpc-status"]
            self._finish(rpc_error(code, details, pairs))
        elif self._partial:
            self.fail(grpc.StatusCode.INTERNAL, "the engine ended the call inside a message")
        else:
            self._finish(None)
        self._release()

    def on_end_without_trailers(self) -> None:
        self.fail(grpc.StatusCode.INTERNAL, "the engine ended the stream without trailers")

    def on_reset(self, error_code: int) -> None:
        code = _RESET_CODES.get(error_code, grpc.StatusCode.INTERNAL)
        self._finish(rpc_error(code, f"the engine reset the stream (HTTP/2 error {error_code})"))
        self._release()

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with an error of our own and tell the engine to stop sending."""
        if self._ended is not None:
            return
        self._finish(rpc_error(code, details))
        conn = self._conn
        if conn is not None:
            conn.reset(self)

    def on_connection_error(self, error: grpc.aio.AioRpcError) -> None:
        self._finish(error)
        self._conn = None

    def _release(self) -> None:
        conn = self._conn
        if conn is not None:
            conn.forget(self)


class UnaryCall(Call):
    """A call with exactly one reply; awaiting it gives that reply."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._reply().__await__()

    async def _reply(self) -> Any:
        reply = await self.read()
        if reply is EOF:
            raise rpc_error(grpc.StatusCode.INTERNAL, "the engine sent no reply")
        if await self.read() is not EOF:
            raise rpc_error(grpc.StatusCode.INTERNAL, "the engine sent more than one reply")
        return reply


# ---------------------------------------------------------------- the connection


class Connection(asyncio.Protocol):
    """The client end of one HTTP/2 connection; calls are started with :meth:`start`."""

    def __init__(
        self,
        max_message: int,
        on_closed: Callable[[Connection], None],
        resend: Callable[[Call, bytes, bytes], None],
    ) -> None:
        self.max_message = max_message
        self._on_closed = on_closed
        self._resend = resend
        self._transport: asyncio.Transport | None = None
        self._calls: dict[int, Call] = {}
        self._next_id = 1
        self._decoder = HeaderDecoder()
        self._buffer = b""
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._peer_window = DEFAULT_WINDOW
        self._peer_max_streams = MAX_WINDOW
        self._send_window = DEFAULT_WINDOW
        self._credit = 0
        self._blocked: deque[Call] = deque()
        self._queued: deque[tuple[Call, bytes, bytes]] = deque()
        self._header_block: bytearray | None = None
        self._header_stream = 0
        self._header_end = False
        self._error: grpc.aio.AioRpcError | None = None
        self._draining = False
        self._last_recv = 0.0
        self._ping_sent: float | None = None
        self._keepalive: asyncio.TimerHandle | None = None

    @property
    def usable(self) -> bool:
        """Open, and not told to go away: new calls may start here."""
        return self._transport is not None and self._error is None and not self._draining

    @property
    def active(self) -> int:
        return len(self._calls) + len(self._queued)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._transport

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        settings = b"".join(
            _SETTING.pack(key, value)
            for key, value in (
                (SETTINGS_ENABLE_PUSH, 0),
                (SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
            )
        )
        transport.write(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - DEFAULT_WINDOW))
        )
        loop = asyncio.get_running_loop()
        self._last_recv = loop.time()
        self._keepalive = loop.call_later(KEEPALIVE_TIMEOUT_S, self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._close(_unavailable(f"the connection to the engine was lost{reason}"))

    def data_received(self, data: bytes) -> None:
        self._last_recv = -1.0
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        size = len(data)
        at = 0
        calls = self._calls
        while size - at >= 9:
            hi, lo, kind, flags, stream_id = _FRAME.unpack_from(data, at)
            length = (hi << 8) | lo
            end = at + 9 + length
            if end > size:
                break
            stream_id &= MAX_WINDOW
            if kind == DATA:
                self._credit += length
                call = calls.get(stream_id)
                if call is not None:
                    if flags & PADDED:
                        call.on_data(data[at + 10 : end - data[at + 9]], length)
                    else:
                        call.on_data(data[at + 9 : end], length)
                    if flags & END_STREAM:
                        call.on_end_without_trailers()
                if self._credit >= CONNECTION_CREDIT_STEP:
                    self.write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._credit)))
                    self._credit = 0
            elif kind in (HEADERS, CONTINUATION):
                self._on_header_frame(kind, flags, stream_id, data[at + 9 : end])
            else:
                self._on_control(kind, flags, stream_id, data[at + 9 : end])
            if self._transport is None:
                return
            at = end
        if at < size:
            self._buffer = data[at:]

    # -- frames other than DATA

    def _on_header_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == HEADERS:
            if self._header_block is not None:
                self._protocol_error("HEADERS inside another header block")
                return
            start = 0
            end = len(payload)
            if flags & PADDED:
                start = 1
                end -= payload[0]
            if flags & PRIORITY_FLAG:
                start += 5
            self._header_block = bytearray(payload[start:end])
            self._header_stream = stream_id
            self._header_end = bool(flags & END_STREAM)
        elif self._header_block is None or stream_id != self._header_stream:
            self._protocol_error("CONTINUATION without its HEADERS")
            return
        else:
            self._header_block += payload
        if not flags & END_HEADERS:
            return
        block, self._header_block = bytes(self._header_block), None
        try:
            headers = self._decoder.decode(block)
        except hpack.HPACKError as error:
            self._protocol_error(f"undecodable headers: {error}")
            return
        call = self._calls.get(self._header_stream)
        if call is not None:
            call.on_headers(headers, self._header_end)

    def _on_control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == SETTINGS:
            if not flags & ACK:
                self._apply_settings(payload)
                self.write(frame(SETTINGS, ACK, 0))
        elif kind == WINDOW_UPDATE:
            increment = _U32.unpack(payload)[0] & MAX_WINDOW
            if stream_id == 0:
                self._send_window += increment
                self._unblock()
            else:
                call = self._calls.get(stream_id)
                if call is not None:
                    call.send_window += increment
                    self._unblock()
        elif kind == RST_STREAM:
            call = self._calls.get(stream_id)
            if call is not None:
                code = _U32.unpack(payload)[0]
                if code != REFUSED_STREAM or not self._retry(call):
                    call.on_reset(code)
        elif kind == PING:
            if flags & ACK:
                self._ping_sent = None
            else:
                self.write(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self._on_goaway(payload)
        elif kind == PUSH_PROMISE:
            self._protocol_error("PUSH_PROMISE although push is disabled")

    def _apply_settings(self, payload: bytes) -> None:
        for at in range(0, len(payload) - len(payload) % 6, 6):
            key, value = _SETTING.unpack_from(payload, at)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                change = value - self._peer_window
                self._peer_window = value
                for call in self._calls.values():
                    call.send_window += change
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self._peer_max_frame = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self._peer_max_streams = value
        self._unblock()
        self._start_queued()

    def _on_goaway(self, payload: bytes) -> None:
        """Streams above the peer's last one were never processed: they go to a new
        connection; the rest finish here, and the connection closes after them."""
        last = _U32.unpack_from(payload)[0] & MAX_WINDOW
        self._draining = True
        self._on_closed(self)
        untaken: list[tuple[Call, bytes, bytes]] = []
        for stream_id, call in list(self._calls.items()):
            if stream_id > last:
                del self._calls[stream_id]
                untaken.append((call, *(call._request or (b"", b""))))
        untaken.extend(self._queued)
        self._queued.clear()
        refused = _unavailable("the engine went away before taking this request")
        for call, headers, body in untaken:
            call._conn = None
            if call.done():
                continue
            if headers and call._tries < MAX_TRIES:
                call._tries += 1
                self._resend(call, headers, body)
            else:
                call.on_connection_error(refused)
        if not self._calls and self._transport is not None:
            self._transport.close()

    def _retry(self, call: Call) -> bool:
        """Queue a stream the peer refused (REFUSED_STREAM: not processed) to be sent again."""
        request = call._request
        if request is None or call._tries >= MAX_TRIES:
            return False
        del self._calls[call.stream_id]
        call._tries += 1
        self._queued.append((call, *request))
        asyncio.get_running_loop().call_soon(self._start_queued)
        return True

    def _protocol_error(self, what: str) -> None:
        if self._transport is not None:
            self._transport.write(frame(GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(0x1)))
            self._transport.abort()
        self._close(rpc_error(grpc.StatusCode.INTERNAL, f"HTTP/2 protocol error: {what}"))

    # -- calls

    def start(self, call: Call, headers: bytes, body: bytes) -> None:
        """Send the call's request now (or once the peer's stream limit allows)."""
        if not self.usable:
            call.on_connection_error(self._error or _unavailable("the connection is closing"))
            return
        call._conn = self
        if len(self._calls) >= self._peer_max_streams:
            self._queued.append((call, headers, body))
            return
        self._open(call, headers, body)

    def _open(self, call: Call, headers: bytes, body: bytes) -> None:
        stream_id = self._next_id
        self._next_id += 2
        call.stream_id = stream_id
        call.send_window = self._peer_window
        call._request = (headers, body)
        self._calls[stream_id] = call
        head = frame(HEADERS, END_HEADERS, stream_id, headers)
        size = len(body)
        if size <= self._peer_max_frame and size <= self._send_window and size <= call.send_window:
            self._send_window -= size
            call.send_window -= size
            self.write(head + frame(DATA, END_STREAM, stream_id, body))
            return
        self.write(head)
        call._out = body
        self._blocked.append(call)
        self._unblock()

    def _start_queued(self) -> None:
        while self._queued and len(self._calls) < self._peer_max_streams and self.usable:
            call, headers, body = self._queued.popleft()
            if not call.done():
                self._open(call, headers, body)

    def _unblock(self) -> None:
        blocked = self._blocked
        for _ in range(len(blocked)):
            call = blocked.popleft()
            if call.done() or self._calls.get(call.stream_id) is not call:
                continue
            out = call._out
            while out and self._send_window > 0 and call.send_window > 0:
                size = min(len(out), self._peer_max_frame, self._send_window, call.send_window)
                chunk, out = out[:size], out[size:]
                self._send_window -= size
                call.send_window -= size
                self.write(frame(DATA, 0 if out else END_STREAM, call.stream_id, chunk))
            call._out = out
            if out:
                blocked.append(call)

    def reset(self, call: Call) -> None:
        if self._calls.pop(call.stream_id, None) is call:
            self.write(frame(RST_STREAM, 0, call.stream_id, _U32.pack(CANCEL)))
            self._after_release()
        call._conn = None

    def forget(self, call: Call) -> None:
        if self._calls.pop(call.stream_id, None) is call:
            self._after_release()
        call._conn = None

    def _after_release(self) -> None:
        if self._queued:
            self._start_queued()
        if self._draining and not self._calls and self._transport is not None:
            self._transport.close()

    def write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def close(self) -> None:
        self._close(_unavailable("the gateway closed the connection"))

    def _close(self, error: grpc.aio.AioRpcError) -> None:
        if self._error is None:
            self._error = error
        transport, self._transport = self._transport, None
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        calls = list(self._calls.values())
        self._calls.clear()
        for call in calls:
            call.on_connection_error(self._error)
        while self._queued:
            self._queued.popleft()[0].on_connection_error(self._error)
        self._on_closed(self)
        if transport is not None:
            transport.close()

    def _tick(self) -> None:
        """Keepalive: with calls open and nothing heard for a while, PING; no answer, close."""
        transport = self._transport
        if transport is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._last_recv < 0:
            self._last_recv = now
            self._ping_sent = None
        if self._ping_sent is not None and now - self._ping_sent >= KEEPALIVE_TIMEOUT_S:
            transport.abort()
            self._close(_unavailable("the engine stopped answering keepalive pings"))
            return
        if self._calls and self._ping_sent is None and now - self._last_recv >= KEEPALIVE_S:
            self._ping_sent = now
            self.write(frame(PING, 0, 0, bytes(8)))
        self._keepalive = loop.call_later(KEEPALIVE_TIMEOUT_S, self._tick)
