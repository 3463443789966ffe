"""The client role of the HTTP/2 core: just enough gRPC for vLLM's two Inference calls.

Why not grpcio here: every message grpc.aio hands out crosses three threads (C-core's event
engine reads the socket, a poller thread drains the completion queue and wakes the event loop
through a socket) and costs far more CPU than the whole per-token budget. This protocol feeds
the socket's bytes to the sans-IO core (:mod:`rankgate.wire.h2`) in the event loop's own
``data_received``, and the core hands each DATA frame to the waiting call directly; control-
plane RPCs stay on grpcio.

What it adds to the core: gRPC's HTTP/2 mapping (each call a
:class:`rankgate.sidecar.grpc_call.Call`: request header blocks as literals, length-prefixed
messages, status trailers and Trailers-Only responses, never compression), PING as keepalive, the
peer's concurrency limit as a queue, REFUSED_STREAM and GOAWAY as a resend of requests the engine
never processed, and a new connection once stream ids run out. Every failure reaches the reader as a
:mod:`rankgate.sidecar.errors` type, translated in one place (:mod:`rankgate.sidecar.status`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from rankgate.sidecar.errors import SidecarError
from rankgate.sidecar.grpc_call import STREAM_WINDOW, Call
from rankgate.sidecar.status import (
    Status,
    error_from_h2,
    error_from_status,
)
from rankgate.wire.h2.connection import MAX_HEADER_BLOCK, H2Connection
from rankgate.wire.h2.errors import H2ConnectionError
from rankgate.wire.h2.frames import (
    MAX_STREAM_ID,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    ErrorCode,
)

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

_SETTINGS = (
    (SETTINGS_ENABLE_PUSH, 0),
    (SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
    (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK),
)
_CANCEL = ErrorCode.CANCEL


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
        self.loop: asyncio.AbstractEventLoop | None = None
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
        loop = self.loop = asyncio.get_running_loop()
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
                    call.wake()
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
                untaken.append((call, *(call.sent or (b"", b""))))
        untaken.extend(self._queued)
        self._queued.clear()
        for call, headers, body in untaken:
            call.conn = None
            if call.done():
                continue
            if headers and call.tries < MAX_TRIES:
                call.tries += 1
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
        request = call.sent
        if request is None or call.tries >= MAX_TRIES:
            return False
        call.tries += 1
        self._queued.appendleft((call, *request))
        delay = min(REFUSED_BACKOFF_S * (1 << (call.tries - 1)), REFUSED_BACKOFF_MAX_S)
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
        call.conn = self
        if len(self.streams) >= self.peer_max_streams:
            self._queued.append((call, headers, body))
            return
        self._open(call, headers, body)

    def _open(self, call: Call[Any], headers: bytes, body: bytes) -> None:
        if self.next_stream_id > MAX_STREAM_ID:
            # Every stream id of this connection is used: it drains, the call moves on.
            self._retire()
            call.conn = None
            self._resend(call, headers, body)
            return
        stream_id = self.open_stream(call)
        call.sent = (headers, body)
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
            call.conn = None
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
        call.conn = None

    def forget(self, call: Call[Any]) -> None:
        """The call ended on both sides."""
        if self.streams.get(call.stream_id) is call:
            self.close_stream(call)
            self._after_release()
        call.conn = None

    def released(self, call: Call[Any]) -> None:
        """The core already dropped the call's stream (reset by the peer, or a stream error)."""
        call.conn = None
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
