"""One gRPC call on the gateway's HTTP/2 client connection (:mod:`rankgate.sidecar.http2`).

A call is a stream of the sans-IO core (:mod:`rankgate.wire.h2`) that frames its request as gRPC
does (a header block of literals that never touch the peer's table, one length-prefixed
message, never compression) and reads its replies: length-prefixed messages cut from DATA
frames, status trailers and Trailers-Only responses, each failure a :mod:`rankgate.sidecar.errors`
type translated in one place (:mod:`rankgate.sidecar.status`).

Receive flow control bounds memory: a stream's window is only re-opened for bytes that are no
longer waiting in its queue of unread messages, so a slow reader stops the engine rather than
filling the gateway. A reader that fell behind takes what waits merged into one message.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import unquote

from rankgate.sidecar.errors import BadEngineResponse, SidecarError
from rankgate.sidecar.status import (
    Status,
    error_from_h2,
    error_from_http_status,
    error_from_reset,
    error_from_status,
)
from rankgate.wire.grpc_frame import MESSAGE_HEAD
from rankgate.wire.h2.connection import H2Stream
from rankgate.wire.h2.errors import H2StreamError
from rankgate.wire.h2.frames import ErrorCode
from rankgate.wire.h2.headers import hpack_int, hpack_str

# What each stream may have buffered and unread, and the share of it re-opened at a time.
STREAM_WINDOW = 4 << 20
STREAM_CREDIT_STEP = STREAM_WINDOW // 4
# A stream's window is re-opened once what it still allows plus what waits unread is this low.
_GRANT_AT = STREAM_WINDOW - STREAM_CREDIT_STEP
# Messages merged into one read at most: a reader far behind still gets its output in steps.
MAX_MERGED = 32

_REFUSED_STREAM = ErrorCode.REFUSED_STREAM

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


class CallHost(Protocol):
    """The connection a call runs on (:class:`rankgate.sidecar.http2.Connection`), as the call uses
    it."""

    max_message: int
    # The loop it runs on, once connected.
    loop: asyncio.AbstractEventLoop | None
    # Calls with messages for a waiting reader, resolved once the bytes received are parsed.
    ready: list[Call[Any]]

    def grant(self, stream: Any, increment: int) -> None: ...

    def flush(self) -> None: ...

    def reset(self, call: Call[Any]) -> None: ...

    def retry(self, call: Call[Any]) -> bool: ...

    def forget(self, call: Call[Any]) -> None: ...

    def released(self, call: Call[Any]) -> None: ...


# ---------------------------------------------------------------- calls


class Call(H2Stream, Generic[T]):
    """One RPC on a connection: its request is sent at once, its replies queue up here.

    ``read()`` returns the next message (parsed by ``parse``), None after an OK status, or
    raises a :class:`~rankgate.sidecar.errors.SidecarError`; iterating yields the messages. Once
    ``cancel()`` ran it raises ``CancelledError``.
    """

    __slots__ = (
        "_cancelled",
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
        "_retry_after",
        "_waiter",
        "conn",
        "push",
        "sent",
        "tries",
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
        self.conn: CallHost | None = None
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
        self.sent: tuple[bytes, bytes] | None = None
        self.tries = 0
        # Offered each message that arrives while its reader waits; one it takes (True) is not
        # handed to the reader, which is woken only for a message it declines or the end.
        self.push: Callable[[T], bool] | None = None

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
            # Python 3.11's get_running_loop() makes a getpid() system call each time: a call
            # takes its connection's loop, and asks only when it has none yet.
            conn = self.conn
            loop = conn.loop if conn is not None else None
            if loop is None:
                loop = asyncio.get_running_loop()
            self._loop = loop
        future: asyncio.Future[T] = loop.create_future()
        if not self._resolve(future):
            self._waiter = future
        return future

    def _resolve(self, future: asyncio.Future[T], push: Callable[[T], bool] | None = None) -> bool:
        """Give ``future`` the next message that ``push`` (when given) does not take, or the
        end of the call; False when neither is there yet."""
        while True:
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
            if message is None or push is None:
                break
            try:
                if not push(message):
                    break
            except Exception as failure:
                # The consumer failed on a message it took: its reader raises the failure.
                future.set_exception(failure)
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
        if self._ended and not self._messages and not self._pending:
            # The trailers came with the reply (they nearly always do): the call ended well
            # with nothing after it, which a second read would only confirm.
            return reply
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
        conn = self.conn
        if conn is not None:
            conn.reset(self)
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._ended is not None

    # -- connection side

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            if waiter.done():
                # Its reader was cancelled; the message stays queued for the next read.
                self._waiter = None
            elif self._resolve(waiter, self.push):
                self._waiter = None

    def _finish(self, error: BaseException | None) -> None:
        if self._ended is not None:
            return
        self._ended = error is None
        self._error = error
        self.wake()

    def on_data(self, data: bytes, flow: int, end_stream: bool) -> None:
        if self._ended is not None:
            return
        if end_stream:
            self.fail(Status.INTERNAL, "the engine ended the stream without trailers")
            return
        conn = self.conn
        if not self._partial and conn is not None:
            # The common frame: exactly one whole message (vLLM sends one per token).
            size = len(data)
            if size >= 5:
                compressed, length = MESSAGE_HEAD.unpack_from(data)
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
        limit = self.conn.max_message if self.conn is not None else 0
        while size - at >= 5:
            compressed, length = MESSAGE_HEAD.unpack_from(data, at)
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
        if queued and self._waiter is not None and self.conn is not None:
            # Woken once the whole read is handled, so a reader that waits gets every
            # message of it at once.
            self.conn.ready.append(self)

    def _maybe_credit(self) -> None:
        """Re-open the stream window for what was received and is no longer held unread."""
        grant = STREAM_WINDOW - self.recv_window - self._held
        conn = self.conn
        if grant >= STREAM_CREDIT_STEP and self._ended is None and conn is not None:
            conn.grant(self, grant)
            conn.flush()

    def on_headers(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        if self._ended is not None:
            return
        if not self._got_headers:
            self._got_headers = True
            self.sent = None
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
        conn = self.conn
        if conn is not None:
            conn.forget(self)

    def on_reset(self, code: int) -> None:
        conn = self.conn
        if conn is None:
            return
        if code == _REFUSED_STREAM and conn.retry(self):
            return
        self._finish(error_from_reset(code, self._retry_after))
        conn.released(self)

    def on_stream_error(self, error: H2StreamError) -> None:
        self._finish(error_from_h2(error, self._retry_after))
        conn = self.conn
        if conn is not None:
            conn.released(self)

    def fail(self, code: Status, details: str) -> None:
        """End the call with an error of our own and tell the engine to stop sending."""
        self._end_with(error_from_status(code, details, self._retry_after))

    def _end_with(self, error: SidecarError) -> None:
        if self._ended is not None:
            return
        self._finish(error)
        conn = self.conn
        if conn is not None:
            conn.reset(self)

    def on_connection_error(self, error: SidecarError) -> None:
        self._finish(error)
        self.conn = None


class UnaryCall(Call[T]):
    """A call with exactly one reply; awaiting it gives that reply."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, T]:
        return self.reply().__await__()
