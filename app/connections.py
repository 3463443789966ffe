"""HTTP/1.1 connection limits: header size and count, header/body/idle timeouts, a connection cap.

uvicorn's httptools protocol has no limit on a request's head (llhttp has none, and httptools
buffers a header name or value until it ends), no deadline for a request's headers or body,
and no connection cap of its own. :class:`LimitedHttpToolsProtocol` is that protocol with
those limits added where the bytes arrive:

- the head (request line and headers) may hold ``max_header_bytes`` and ``max_headers``;
  past either the client gets 431 and the connection is closed, before the bytes are parsed
  further, so a 200 MB header costs at most the limit in memory;
- a request's headers must be complete within ``header_timeout`` of the connection opening
  or of the previous response ending (slowloris), and its body within ``body_timeout`` of its
  headers (slow uploads): 408, then the connection is closed; a connection that never sends
  a byte is closed silently;
- an idle keep-alive connection is closed after ``keepalive_timeout`` (uvicorn's own timer);
- a worker holds at most ``max_connections`` at once. A connection past the cap takes the
  place of the connection that has waited longest without a request in flight (an idle
  keep-alive, a socket that never sent a byte, a head still trickling in), which is closed,
  sparing only those younger than ``eviction_grace`` (their request may be on its way): a
  flood of idle or slow sockets cannot lock anyone out. When every connection has a request
  in flight, a few more (``reserve``) are let in for ``/health`` and ``/ready`` alone, so the
  orchestrator's probes still answer under a full cap; anything else there, or past those, is
  answered 503 and closed.

The protocol also tells the app when a client leaves: every request's scope holds a
:class:`DisconnectNotice` (under ``DISCONNECT_NOTICE``), fired when the connection is lost or
refused before the response is complete. uvicorn itself tells only a ``receive`` that is
waiting, which would cost a task per request to keep waiting.

Deadlines cost no timer per request: each connection stores when its current phase must end,
and one sweeper per worker looks at the open connections a few times a second. Every answer
given here is OpenAI error JSON, like the app's, including httptools' parse errors (400).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from rankgate.app.errors import ApiError

log = logging.getLogger(__name__)
_U32 = struct.Struct("=I")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    # Bytes of a request's head: request line and headers.
    max_header_bytes: int = 32 << 10
    max_headers: int = 128
    # Seconds for a request's whole head, from connect or from the previous response.
    header_timeout: float = 10.0
    # Seconds for a request's whole body, from the end of its head.
    body_timeout: float = 60.0
    # Seconds an idle keep-alive connection is kept (uvicorn counts whole seconds).
    keepalive_timeout: int = 5
    # Open connections per worker process.
    max_connections: int = 2048

    @property
    def eviction_grace(self) -> float:
        """Seconds a connection without a request in flight is spared from eviction."""
        return min(1.0, self.header_timeout / 4)

    @property
    def reserve(self) -> int:
        """Connections past the cap let in for the health probes while every slot is busy."""
        return max(4, self.max_connections // 64)

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be at least 1024")
        if self.max_headers < 8:
            raise ValueError("max_headers must be at least 8")
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")


# What a connection let in past the cap may ask for.
PROBE_PATHS = frozenset({b"/health", b"/ready"})

# The scope key of a request's DisconnectNotice.
DISCONNECT_NOTICE = "rankgate.disconnect"
# The scope key of the connection's PeerWindow.
PEER_WINDOW = "rankgate.peer_window"
# The scope key of the uvicorn cycle a request's response goes out on (see ChunkWriter.of).
_RESPONSE_CYCLE = "rankgate.response_cycle"
_TCP_INFO_LEN = 232


class PeerWindow:
    """The receive window the client's TCP last advertised, read from Linux's ``TCP_INFO``.

    A client whose application reads keeps its window open; one that stopped reading lets
    every byte that arrives shrink it, long before the buffers on either side fill (megabytes,
    at a stream's few kilobytes a second: minutes). ``sample`` gives the window and its
    granularity (the client's window scale), or None where the kernel does not tell.
    """

    __slots__ = ("_sock",)

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def sample(self) -> tuple[int, int] | None:
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except (OSError, AttributeError):
            return None
        if len(info) < _TCP_INFO_LEN:
            return None
        # tcpi_snd_wnd, and tcpi_snd_wscale (the low half of the seventh byte).
        window: int = _U32.unpack_from(info, 228)[0]
        return window, 1 << (info[6] & 0x0F)


class DisconnectNotice:
    """Calls its ``listener`` (once, if one is set) when the client's connection is gone
    before the response is complete."""

    __slots__ = ("listener",)

    def __init__(self) -> None:
        self.listener: Callable[[], None] | None = None

    def fire(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener()


def _response_cycle(scope: Mapping[str, Any]) -> Any:
    """The uvicorn cycle answering ``scope``'s request, while it lives; None under another
    server. The scope holds it weakly: the cycle holds the scope, and a strong reference back
    would leave every request's objects to the cyclic collector instead of freeing them when
    the request ends (a young collection every few hundred requests, tens of microseconds a
    request, on the event loop)."""
    ref = scope.get(_RESPONSE_CYCLE)
    return None if ref is None else ref()


def _client_left(cycle: Any) -> None:
    notice = cycle.scope.get(DISCONNECT_NOTICE)
    if notice is not None:
        notice.fire()


class _HeadTooLarge(Exception):
    pass


class _ProbesOnly(Exception):
    """A request other than a probe on a connection let in past the cap."""


def _answer(status: int, message: str, code: str, default_headers: list[Any]) -> bytes:
    body = ApiError(status, message, code=code).body()
    lines = [STATUS_LINE[status]]
    for name, value in default_headers:
        lines.extend([name, b": ", value, b"\r\n"])
    lines.append(
        b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % len(body)
    )
    lines.append(body)
    return b"".join(lines)


class ChunkWriter:
    """Writes a streamed response's chunks straight to the socket, past the ASGI ``send``.

    A streamed token is one chunk, and each passing through ``send`` resumes a coroutine
    per middleware layer and uvicorn's own, to reach the one ``transport.write`` it ends in.
    :meth:`write` makes that write itself, framed as uvicorn frames it, when nothing else
    would happen: the response has started with chunked framing, is not complete, the client
    is connected and the socket takes writes. Otherwise it returns False and the chunk goes
    through ``send``, which waits for the socket to drain, or drops the chunk for a client that
    left, as it always does.
    """

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    @classmethod
    def of(cls, scope: Mapping[str, Any]) -> ChunkWriter | None:
        """The writer for the response to ``scope``'s request; None under another server.
        Built when a stream asks for it: most responses are not streamed."""
        cycle = _response_cycle(scope)
        return None if cycle is None else cls(cycle)

    def ready(self) -> bool:
        """Whether :meth:`write` would write now."""
        cycle = self._cycle
        return (
            cycle.chunked_encoding is True
            and not cycle.response_complete
            and not cycle.disconnected
            and not cycle.flow.write_paused
        )

    def write(self, body: bytes) -> bool:
        if not self.ready():
            return False
        self.write_ready(body)
        return True

    def write_ready(self, body: bytes) -> None:
        """Write ``body``, :meth:`ready` having said just now that it may be written."""
        self._cycle.transport.write(b"".join((b"%x\r\n" % len(body), body, b"\r\n")))


class WholeAnswer:
    """Writes a whole response, head and body, in one write past the ASGI ``send``.

    A JSON answer sent through ``send`` is two messages, each resuming a coroutine per
    middleware layer and uvicorn's own, whose head is then checked, lowered and framed header
    by header. When nothing between the app and uvicorn listens to ``send`` (:meth:`of` is
    given the ``send`` the caller holds, and answers None unless it is uvicorn's own), the
    same bytes can be written at once, and the cycle's state left as ``send`` leaves it. A
    response this cannot frame the same way (a header ``send`` would refuse or that changes
    the framing, a length that does not match, a paused or closed socket) is left to ``send``.
    """

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    @classmethod
    def of(cls, scope: Mapping[str, Any], send: Any) -> WholeAnswer | None:
        cycle = _response_cycle(scope)
        if cycle is None or send != cycle.send:
            return None
        return cls(cycle)

    def write(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write the response; False (nothing written) when ``send`` must do it instead."""
        cycle = self._cycle
        scope = cycle.scope
        if (
            cycle.response_started
            or cycle.disconnected
            or cycle.flow.write_paused
            or scope["method"] == "HEAD"
        ):
            return False
        content = [STATUS_LINE[status]]
        length = -1
        for name, value in (*cycle.default_headers, *headers):
            if name == b"content-length":
                if not value.isdigit():
                    return False
                length = int(value)
            elif name in _FRAMING or name != name.lower():
                return False
            content += (name, b": ", value, b"\r\n")
        if length != len(body):
            return False
        if HEADER_RE.search(b"".join(content[1::4])) or HEADER_VALUE_RE.search(
            b"".join(content[3::4])
        ):
            return False
        if not cycle.keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        transport = cycle.transport
        if isinstance(transport, HeldHead):
            transport = transport.detach()
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = False
        cycle.expected_content_length = 0
        if cycle.access_log:
            cycle.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(scope),
                scope["method"],
                get_path_with_query_string(scope),
                scope["http_version"],
                status,
            )
        transport.write(b"".join(content))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            transport.close()
        cycle.on_response()
        return True


# Headers that change how a response is framed or whether its connection stays open.
_FRAMING = frozenset({b"connection", b"transfer-encoding"})


class HeldHead:
    """A response cycle's transport until the cycle's first write has gone out.

    uvicorn writes a response's head when the app sends ``http.response.start`` and its body
    at the next message: two writes, two TCP segments, each costing the gateway's core about
    as much again in the kernel as the other. The first write (the head) is held instead; the
    next one, which for a whole JSON answer comes in the same loop tick, leaves with it as one
    write. A head with nothing after it in its tick (a stream's) goes out alone at the tick's
    end. Either way the cycle then has its transport back: every later write is direct.
    """

    __slots__ = ("_cycle", "_held", "_loop", "_transport")

    def __init__(self, cycle: Any, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._cycle = cycle
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is None:
            self._held = data
            self._loop.call_soon(self._flush)
            return
        self._release()
        self._transport.write(held + data)

    def detach(self) -> asyncio.Transport:
        """The transport itself, handed back to the cycle, after anything held (a ``100
        Continue``) is written."""
        self._flush()
        self._release()
        return self._transport

    def _release(self) -> None:
        self._held = None
        if self._cycle.transport is self:
            self._cycle.transport = self._transport

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._release()
            if not self._transport.is_closing():
                self._transport.write(held)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._flush()
        self._transport.close()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`ConnectionLimits`; see the module docstring.

    Build the class for a set of limits with :func:`protocol_class`.
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    # One sweeper per server, keyed by its set of open connections.
    _sweepers: ClassVar[dict[int, set[Any]]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._deadline = 0.0
        self._refused = False
        # Since when this connection has waited without a request in flight.
        self._waiting_since = 0.0
        # Let in past the cap for the health probes only.
        self._reserved = False
        self._window: PeerWindow | None = None

    # ---- connection --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting_since = self.loop.time()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self._window = PeerWindow(sock)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            log.warning(
                "refused a connection: %d open, every one with a request in flight; the cap "
                "is %d per worker",
                len(self.connections) - 1,
                self.limits.max_connections,
            )
            self._refuse_busy()
            return
        self._deadline = self.loop.time() + self.limits.header_timeout
        self._ensure_sweeper()

    def _make_room(self) -> bool:
        """Close the connection waiting longest without a request in flight, or let this one
        in for the probes; False when neither can be done."""
        oldest: LimitedHttpToolsProtocol | None = None
        reserved = 0
        # A connection this fresh may have its request on the way, not yet read: it is spared.
        spared = self._waiting_since - self.limits.eviction_grace
        for other in self.connections:
            if other is self or not isinstance(other, LimitedHttpToolsProtocol):
                continue
            reserved += other._reserved
            since = other._waiting_since
            if (
                since <= spared
                and other._idle()
                and (oldest is None or since < oldest._waiting_since)
            ):
                oldest = other
        if oldest is not None:
            oldest._refused = True
            oldest._deadline = 0.0
            oldest.transport.close()
            return True
        if reserved < self.limits.reserve:
            self._reserved = True
            return True
        return False

    def _idle(self) -> bool:
        cycle = self.cycle
        return (
            self._in_head
            and not self._refused
            and (cycle is None or cycle.response_complete)
            and not self.transport.is_closing()
        )

    def _refuse_busy(self) -> None:
        self._refuse(
            503, "The server has too many open connections; retry later.", "too_many_connections"
        )

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            _client_left(cycle)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        try:
            if self._in_head:
                allowed = self.limits.max_header_bytes - self._head_bytes
                if len(data) > allowed:
                    # Parse what fits; the rest is only parsed if the head ended inside it.
                    self.parser.feed_data(data[:allowed])
                    if self._in_head:
                        raise _HeadTooLarge
                    data = data[allowed:]
                else:
                    self._head_bytes += len(data)
            self.parser.feed_data(data)
        except _HeadTooLarge:
            self._head_too_large()
        except _ProbesOnly:
            self._refuse_busy()
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._head_too_large()
            elif isinstance(exc.__context__, _ProbesOnly):
                self._refuse_busy()
            else:
                raise
        except httptools.HttpParserError:
            log.info("refused a request that is not valid HTTP/1.1")
            self._refuse(400, "Invalid HTTP request received.", "invalid_http")

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg, "invalid_http")

    # ---- parser callbacks --------------------------------------------------------------

    def on_headers_complete(self) -> None:
        if len(self.headers) > self.limits.max_headers:
            raise _HeadTooLarge
        if self._reserved and httptools.parse_url(self.url).path not in PROBE_PATHS:
            raise _ProbesOnly
        self._in_head = False
        self._head_bytes = 0
        self._deadline = self.loop.time() + self.limits.body_timeout
        self.scope[DISCONNECT_NOTICE] = DisconnectNotice()  # type: ignore[literal-required]
        if self._window is not None:
            self.scope[PEER_WINDOW] = self._window  # type: ignore[literal-required]
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not before and cycle is not None:
            self.scope[_RESPONSE_CYCLE] = weakref.ref(cycle)  # type: ignore[literal-required]
            # The cycle calls only write, close and is_closing on its transport.
            cycle.transport = HeldHead(cycle, self.transport, self.loop)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # The response is the app's to time; the next head's bytes count from here.
        self._deadline = 0.0
        self._in_head = True
        if not self.pipeline:
            # A body over uvicorn's high-water mark paused reading until the app read it; the
            # connection is read on, so that a client that leaves is seen leaving. (Reading
            # stays paused behind a pipelined request, as uvicorn has it.)
            self.flow.resume_reading()

    def on_response_complete(self) -> None:
        waiting = not self.pipeline
        super().on_response_complete()
        if self._reserved:
            # A probe's place past the cap is for one answer.
            self.transport.close()
            return
        if waiting and not self.transport.is_closing():
            self._waiting_since = self.loop.time()
            self._deadline = self._waiting_since + self.limits.header_timeout

    # ---- refusals ----------------------------------------------------------------------

    def _head_too_large(self) -> None:
        limits = self.limits
        log.info("refused a request whose headers are over the limits")
        self._refuse(
            431,
            f"The request's headers are too large: at most {limits.max_header_bytes} bytes "
            f"and {limits.max_headers} headers are accepted.",
            "headers_too_large",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` unless a response has begun, then close the connection; a
        request still running is told its client is gone."""
        self._refused = True
        self._deadline = 0.0
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
            _client_left(cycle)
        if not answered and not self.transport.is_closing():
            self.transport.write(_answer(status, message, code, self.server_state.default_headers))
        self.transport.close()

    def _expire(self) -> None:
        if self._in_head:
            if self._head_bytes == 0 and (self.cycle is None or self.cycle.response_complete):
                self._refused = True
                self._deadline = 0.0
                self.transport.close()
                return
            self._refuse(
                408,
                f"The request's headers did not arrive within {self.limits.header_timeout:g}s.",
                "request_timeout",
            )
            return
        log.info("closed a connection whose request body was not complete in time")
        self._refuse(
            408,
            f"The request's body did not arrive within {self.limits.body_timeout:g}s.",
            "request_timeout",
        )

    # ---- the sweeper -------------------------------------------------------------------

    def _ensure_sweeper(self) -> None:
        key = id(self.connections)
        if self._sweepers.get(key) is not self.connections:
            self._sweepers[key] = self.connections
            tick = self._tick()
            self.loop.call_later(tick, _sweep, self.loop, self.connections, key, tick)

    def _tick(self) -> float:
        shortest = min(self.limits.header_timeout, self.limits.body_timeout)
        return max(0.05, min(1.0, shortest / 4))


def _sweep(loop: asyncio.AbstractEventLoop, connections: set[Any], key: int, tick: float) -> None:
    now = loop.time()
    for protocol in list(connections):
        if isinstance(protocol, LimitedHttpToolsProtocol):
            deadline = protocol._deadline
            if deadline and deadline < now and not protocol.transport.is_closing():
                protocol._expire()
    sweepers = LimitedHttpToolsProtocol._sweepers
    if connections and sweepers.get(key) is connections:
        loop.call_later(tick, _sweep, loop, connections, key, tick)
    elif sweepers.get(key) is connections:
        del sweepers[key]


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn builds one instance of per connection, with ``limits``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


def uvicorn_config(app: Any, limits: ConnectionLimits, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration every gateway process serves with: uvloop, the limited
    httptools protocol, and its keep-alive timeout; ``options`` add the rest.

    uvicorn's proxy-headers middleware is off: it rewrites a request's client address and
    scheme from ``X-Forwarded-*``, and the gateway reads neither, so it was a scan of every
    request's headers for nothing. Nor does a response say ``server: uvicorn``, nor does
    uvicorn log each request: the gateway logs its own line (:mod:`app.access_log`)."""
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=protocol_class(limits),
        timeout_keep_alive=limits.keepalive_timeout,
        proxy_headers=False,
        server_header=False,
        **{"access_log": False, **options},
    )
