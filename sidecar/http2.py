"""The client role of the HTTP/2 core: just enough gRPC for vLLM's two Inference calls.

Why not grpcio here: every message grpc.aio hands out crosses three threads (C-core's event
engine reads the socket, a poller thread drains the completion queue and wakes the event loop
through a socket) and costs far more CPU than the whole per-token budget. This protocol feeds
the socket's bytes to the sans-IO core (:mod:`sidecar.h2`) in the event loop's own
``data_received``, and the core hands each DATA frame to the waiting call directly; control-
plane RPCs stay on grpcio.

What it adds to the core: gRPC's HTTP/2 mapping (request header blocks as literals, length-
prefixed messages, status trailers and Trailers-Only responses, never compression), PING as
keepalive, the peer's concurrency limit as a queue, REFUSED_STREAM and GOAWAY as a resend of
requests the engine never processed, and a new connection once stream ids run out. Every
failure reaches the reader as a :mod:`sidecar.errors` type, translated in one place
(:mod:`sidecar.status`).

Receive flow control bounds memory: a stream's window is only re-opened for bytes that are no
longer waiting in its queue of unread messages, so a slow reader stops the engine rather than
filling the gateway.
"""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar, cast
from urllib.parse import unquote

from rankgate.sidecar.errors import BadEngineResponse, SidecarError
from rankgate.sidecar.h2.connection import MAX_HEADER_BLOCK, H2Connection, H2Stream
from rankgate.sidecar.h2.errors import H2ConnectionError, H2StreamError
from rankgate.sidecar.h2.frames import (
    MAX_STREAM_ID,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    ErrorCode,
)
from rankgate.sidecar.h2.headers import hpack_int, hpack_str
from rankgate.sidecar.status import (
    Status,
    error_from_h2,
    error_from_http_status,
    error_from_reset,
    error_from_status,
)

# What each stream may have buffered and unread, and the share of it re-opened at a time.
STREAM_WINDOW = 4 << 20
STREAM_CREDIT_STEP = STREAM_WINDOW // 4
# A stream's window is re-opened once what it still allows plus what waits unread is this low.
_GRANT_AT = STREAM_WINDOW - STREAM_CREDIT_STEP
CONNECTION_WINDOW = 64 << 20
CONNECTION_CREDIT_STEP = CONNECTION_WINDOW // 4
KEEPALIVE_S = 30.0
# How often one request is sent again after the engine refused it unprocessed.
MAX_TRIES = 8
# A refused stream is sent again after this, doubling per refusal up to REFUSED_BACKOFF_MAX_S
# (or sooner, when one of ours ends): grpc-core frees a stream's slot only some time after
# its last frame left, so a resend at once meets the same full table.
REFUSED_BACKOFF_S = 0.004
REFUSED_BACKOFF_MAX_S = 0.1
KEEPALIVE_TIMEOUT_S = 10.0
# Messages merged into one read at most: a reader far behind still gets its output in steps.
MAX_MERGED = 32

_SETTINGS = (
    (SETTINGS_ENABLE_PUSH, 0),
    (SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
    (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK),
)
_MESSAGE_HEAD = struct.Struct(">BL")
_REFUSED_STREAM = ErrorCode.REFUSED_STREAM
_CANCEL = ErrorCode.CANCEL

T = TypeVar("T")


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


class Call(H2Stream, Generic[T]):
    """One RPC on a connection: its request is sent at once, its replies queue up here.

    ``read()`` returns the next message (parsed by ``parse``), None after an OK status, or
    raises a :class:`~sidecar.errors.SidecarError`; iterating yields the messages. Once
    ``cancel()`` ran it raises ``CancelledError``.
    """

    __slots__ = (
        "_cancelled",
        "_conn",
        "_ended",
        "_error",
        "_got_headers",
        "_held",
        "_loop",
        "_merge",
        "_messages",
        "_need",
        "_parse",
        "_partial",
        "_partial_size",
        "_pending",
        "_request",
        "_retry_after",
        "_tries",
        "_waiter",
    )

    def __init__(
        self,
        parse: Callable[[bytes], T],
        merge: Callable[[T, list[T]], bool] | None = None,
        retry_after: float = 1.0,
    ) -> None:
        super().__init__()
        self._parse = parse
        # Appends later messages to an earlier one when that loses nothing (True), so a
        # reader that fell behind takes every message already waiting in one go.
        self._merge = merge
        self._retry_after = retry_after
        self._pending: deque[T] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Connection | None = None
        self._messages: deque[bytes] = deque()
        self._partial: list[bytes] = []
        self._partial_size = 0
        self._need = 5
        self._held = 0
        self._waiter: asyncio.Future[T] | None = None
        self._got_headers = False
        # Set once the call is over: None while running, True after an OK status.
        self._ended: bool | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        # The request as sent, kept until the engine answers: a refused stream is resent.
        self._request: tuple[bytes, bytes] | None = None
        self._tries = 0

    # -- consumer side

    async def read(self) -> T | None:
        """The next message, or None once the call ended cleanly."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return None

    def _next(self) -> T | None:
        """The next message, with the messages already waiting behind it merged in when
        ``merge`` accepts them all; None when nothing is waiting."""
        pending = self._pending
        if pending:
            # Left whole by a merge that declined them: handed out one by one, in order.
            return pending.popleft()
        messages = self._messages
        if not messages:
            return None
        data = messages.popleft()
        self._held -= len(data) + 5
        message = self._parse(data)
        merge = self._merge
        if merge is not None and messages:
            take = self._take
            batch = [take(messages) for _ in range(min(len(messages), MAX_MERGED))]
            if not merge(message, batch):
                pending.extend(batch)
        if self.recv_window + self._held <= _GRANT_AT:
            self._maybe_credit()
        return message

    def _take(self, messages: deque[bytes]) -> T:
        data = messages.popleft()
        self._held -= len(data) + 5
        return self._parse(data)

    def __aiter__(self) -> Call[T]:
        return self

    def __anext__(self) -> asyncio.Future[T]:
        """A future of the next message: done already when one is waiting, else resolved by
        the connection with the message itself as it arrives. A plain future rather than a
        coroutine per message: the reader's task resumes one frame less, and a read that
        needs a task of its own (``ensure_future``) gets this future as it is."""
        loop = self._loop
        if loop is None:
            # Once per call: get_running_loop() makes a getpid() system call each time.
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if not self._resolve(future):
            self._waiter = future
        return future

    def _resolve(self, future: asyncio.Future[T]) -> bool:
        """Give ``future`` the next message, or the end of the call; False when neither is
        there yet."""
        try:
            message = self._next()
        except Exception as bad:
            # A reply that does not parse breaks the contract: the engine is not busy, and
            # another rank would not answer better. The engine is told to stop at once.
            broken = BadEngineResponse(f"the engine sent a reply that does not parse: {bad!r}")
            if self._waiter is future:
                self._waiter = None
            self._messages.clear()
            self._pending.clear()
            self._end_with(broken)
            if not future.done():
                future.set_exception(broken)
            return True
        if message is not None:
            future.set_result(message)
            return True
        if self._ended is None:
            return False
        error = self._error
        if error is None:
            future.set_exception(StopAsyncIteration())
        elif isinstance(error, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(error)
        return True

    async def reply(self) -> T:
        """The one message of a call with a unary response; fewer or more is an error."""
        reply = await self.read()
        if reply is None:
            raise error_from_status(Status.INTERNAL, "the engine sent no reply", self._retry_after)
        if await self.read() is not None:
            raise error_from_status(
                Status.INTERNAL, "the engine sent more than one reply", self._retry_after
            )
        return reply

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
        if waiter is not None:
            if waiter.done():
                # Its reader was cancelled; the message stays queued for the next read.
                self._waiter = None
            elif self._resolve(waiter):
                self._waiter = None

    def _finish(self, error: BaseException | None) -> None:
        if self._ended is not None:
            return
        self._ended = error is None
        self._error = error
        self._wake()

    def on_data(self, data: bytes, flow: int, end_stream: bool) -> None:
        if self._ended is not None:
            return
        if end_stream:
            self.fail(Status.INTERNAL, "the engine ended the stream without trailers")
            return
        conn = self._conn
        if not self._partial and conn is not None:
            # The common frame: exactly one whole message (vLLM sends one per token).
            size = len(data)
            if size >= 5:
                compressed, length = _MESSAGE_HEAD.unpack_from(data)
                if size == length + 5 and not compressed and length <= conn.max_message:
                    self._messages.append(data[5:])
                    self._held += size
                    if self.recv_window + self._held <= _GRANT_AT:
                        self._maybe_credit()
                    if self._waiter is not None:
                        conn.ready.append(self)
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
                self._end_with(BadEngineResponse("the engine sent a compressed message"))
                return
            if length > limit:
                self._end_with(
                    BadEngineResponse(f"engine message of {length} bytes exceeds {limit}")
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
        if self.recv_window + self._held <= _GRANT_AT:
            self._maybe_credit()
        if queued and self._waiter is not None and self._conn is not None:
            # Woken once the whole read is handled, so a reader that waits gets every
            # message of it at once.
            self._conn.ready.append(self)

    def _maybe_credit(self) -> None:
        """Re-open the stream window for what was received and is no longer held unread."""
        grant = STREAM_WINDOW - self.recv_window - self._held
        conn = self._conn
        if grant >= STREAM_CREDIT_STEP and self._ended is None and conn is not None:
            conn.grant(self, grant)
            conn.flush()

    def on_headers(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        if self._ended is not None:
            return
        if not self._got_headers:
            self._got_headers = True
            self._request = None
            status = next((v for k, v in headers if k == ":status"), "")
            if status != "200":
                self._end_with(error_from_http_status(status, self._retry_after))
                return
            if not end_stream:
                return
        elif not end_stream:
            self.fail(Status.INTERNAL, "the engine sent headers after its trailers")
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
            self.fail(Status.INTERNAL, "the engine ended the call without a status")
            return
        code = int(status) if status.isascii() and status.isdigit() else Status.UNKNOWN
        if code != Status.OK:
            self._finish(error_from_status(code, details, self._retry_after))
        elif self._partial:
            self.fail(Status.INTERNAL, "the engine ended the call inside a message")
            return
        else:
            self._finish(None)
        conn = self._conn
        if conn is not None:
            conn.forget(self)

    def on_reset(self, code: int) -> None:
        conn = self._conn
        if conn is None:
            return
        if code == _REFUSED_STREAM and conn.retry(self):
            return
        self._finish(error_from_reset(code, self._retry_after))
        conn.released(self)

    def on_stream_error(self, error: H2StreamError) -> None:
        self._finish(error_from_h2(error, self._retry_after))
        conn = self._conn
        if conn is not None:
            conn.released(self)

    def fail(self, code: Status, details: str) -> None:
        """End the call with an error of our own and tell the engine to stop sending."""
        self._end_with(error_from_status(code, details, self._retry_after))

    def _end_with(self, error: SidecarError) -> None:
        if self._ended is not None:
            return
        self._finish(error)
        conn = self._conn
        if conn is not None:
            conn.reset(self)

    def on_connection_error(self, error: SidecarError) -> None:
        self._finish(error)
        self._conn = None


class UnaryCall(Call[T]):
    """A call with exactly one reply; awaiting it gives that reply."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, T]:
        return self.reply().__await__()


# ---------------------------------------------------------------- the connection


class Connection(H2Connection[Call[Any]], asyncio.Protocol):
    """The client end of one HTTP/2 connection; calls are started with :meth:`start`."""

    def __init__(
        self,
        max_message: int,
        on_closed: Callable[[Connection], None],
        resend: Callable[[Call[Any], bytes, bytes], None],
        retry_after: float = 1.0,
    ) -> None:
        super().__init__(
            client=True,
            settings=_SETTINGS,
            connection_window=CONNECTION_WINDOW,
            connection_credit_step=CONNECTION_CREDIT_STEP,
        )
        self.max_message = max_message
        self.retry_after = retry_after
        self._on_closed = on_closed
        self._resend = resend
        self._transport: asyncio.Transport | None = None
        self._queued: deque[tuple[Call[Any], bytes, bytes]] = deque()
        # Calls whose waiting reader got messages in the read being handled.
        self.ready: list[Call[Any]] = []
        self._error: SidecarError | None = None
        self._draining = False
        self._last_recv = 0.0
        self._ping_sent: float | None = None
        self._keepalive: asyncio.TimerHandle | None = None

    @property
    def usable(self) -> bool:
        """Open, not told to go away, and with stream ids left: new calls may start here."""
        # A connection whose stream ids ran out is draining too.
        return self._transport is not None and self._error is None and not self._draining

    @property
    def active(self) -> int:
        return len(self.streams) + len(self._queued)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._transport

    def _failure(self, status: Status, details: str) -> SidecarError:
        return error_from_status(status, details, self.retry_after)

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.initiate()
        self.flush()
        loop = asyncio.get_running_loop()
        self._last_recv = loop.time()
        self._keepalive = loop.call_later(KEEPALIVE_TIMEOUT_S, self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._close(
            self._failure(Status.UNAVAILABLE, f"the connection to the engine was lost{reason}")
        )

    def data_received(self, data: bytes) -> None:
        self._last_recv = -1.0
        try:
            self.receive(data)
        except H2ConnectionError as error:
            self.flush()
            self._close(error_from_h2(error, self.retry_after))
            return
        finally:
            ready = self.ready
            if ready:
                self.ready = []
                for call in ready:
                    call._wake()
        if self.out:
            self.flush()

    def flush(self) -> None:
        """Hand what the core queued to the socket."""
        out = self.out
        if out:
            transport = self._transport
            if transport is not None:
                transport.write(b"".join(out))
            out.clear()

    # -- hooks of the core

    def on_settings(self) -> None:
        self._start_queued()

    def on_ping_ack(self, payload: bytes) -> None:
        self._ping_sent = None

    def on_goaway(self, last_stream_id: int, code: int, debug: bytes) -> None:
        """Streams above the peer's last one were never processed: they go to a new
        connection; the rest finish here, and the connection closes after them."""
        self._draining = True
        self._on_closed(self)
        untaken: list[tuple[Call[Any], bytes, bytes]] = []
        for stream_id, call in list(self.streams.items()):
            if stream_id > last_stream_id:
                self.close_stream(call)
                untaken.append((call, *(call._request or (b"", b""))))
        untaken.extend(self._queued)
        self._queued.clear()
        for call, headers, body in untaken:
            call._conn = None
            if call.done():
                continue
            if headers and call._tries < MAX_TRIES:
                call._tries += 1
                self._resend(call, headers, body)
            else:
                call.on_connection_error(
                    self._failure(
                        Status.UNAVAILABLE, "the engine went away before taking this request"
                    )
                )
        if not self.streams and self._transport is not None:
            self._transport.close()

    def retry(self, call: Call[Any]) -> bool:
        """Queue a stream the peer refused (REFUSED_STREAM: not processed) to be sent again."""
        request = call._request
        if request is None or call._tries >= MAX_TRIES:
            return False
        call._tries += 1
        self._queued.appendleft((call, *request))
        delay = min(REFUSED_BACKOFF_S * (1 << (call._tries - 1)), REFUSED_BACKOFF_MAX_S)
        asyncio.get_running_loop().call_later(delay, self._start_queued)
        return True

    # -- calls

    def start(self, call: Call[Any], headers: bytes, body: bytes) -> None:
        """Send the call's request now (or once the peer's stream limit allows)."""
        if not self.usable:
            call.on_connection_error(
                self._error or self._failure(Status.UNAVAILABLE, "the connection is closing")
            )
            return
        call._conn = self
        if len(self.streams) >= self.peer_max_streams:
            self._queued.append((call, headers, body))
            return
        self._open(call, headers, body)

    def _open(self, call: Call[Any], headers: bytes, body: bytes) -> None:
        if self.next_stream_id > MAX_STREAM_ID:
            # Every stream id of this connection is used: it drains, the call moves on.
            self._retire()
            call._conn = None
            self._resend(call, headers, body)
            return
        stream_id = self.open_stream(call)
        call._request = (headers, body)
        self.send_headers(stream_id, headers, False)
        self.send_data(call, body, True)
        self.flush()
        if self.next_stream_id > MAX_STREAM_ID:
            self._retire()

    def _retire(self) -> None:
        if not self._draining:
            self._draining = True
            self.send_goaway(ErrorCode.NO_ERROR)
            self.flush()
            self._on_closed(self)
        queued = list(self._queued)
        self._queued.clear()
        for call, headers, body in queued:
            call._conn = None
            if not call.done():
                self._resend(call, headers, body)
        self._close_if_idle()

    def _start_queued(self) -> None:
        while self._queued and len(self.streams) < self.peer_max_streams and self.usable:
            call, headers, body = self._queued.popleft()
            if not call.done():
                self._open(call, headers, body)

    def reset(self, call: Call[Any]) -> None:
        """The call is over for us while the engine may still send: RST_STREAM(CANCEL)."""
        if self.streams.get(call.stream_id) is call:
            self.reset_stream(call, _CANCEL)
            self.flush()
            self._after_release()
        call._conn = None

    def forget(self, call: Call[Any]) -> None:
        """The call ended on both sides."""
        if self.streams.get(call.stream_id) is call:
            self.close_stream(call)
            self._after_release()
        call._conn = None

    def released(self, call: Call[Any]) -> None:
        """The core already dropped the call's stream (reset by the peer, or a stream error)."""
        call._conn = None
        self._after_release()

    def _after_release(self) -> None:
        if self._queued:
            self._start_queued()
        if self._draining:
            self._close_if_idle()

    def _close_if_idle(self) -> None:
        if not self.streams and self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        self._close(self._failure(Status.UNAVAILABLE, "the gateway closed the connection"))

    def _close(self, error: SidecarError) -> None:
        if self._error is None:
            self._error = error
        self.closed = True
        transport, self._transport = self._transport, None
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        calls = list(self.streams.values())
        self.streams.clear()
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
            self._close(
                self._failure(Status.UNAVAILABLE, "the engine stopped answering keepalive pings")
            )
            return
        if self.streams and self._ping_sent is None and now - self._last_recv >= KEEPALIVE_S:
            self._ping_sent = now
            self.send_ping(bytes(8))
            self.flush()
        self._keepalive = loop.call_later(KEEPALIVE_TIMEOUT_S, self._tick)
