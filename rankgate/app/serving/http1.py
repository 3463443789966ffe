"""The gateway's HTTP/1.1 server: ``httptools`` parsing straight into ASGI, with limits.

uvicorn runs the process (sockets, signals, lifespan, graceful shutdown) and builds one
:class:`Http1Protocol` per connection, the class :func:`uvicorn_config` names. The protocol
is uvicorn's httptools protocol in what the app sees (the same scope, messages and framing)
and does less per request: the request's state is one :class:`Exchange` with plain flags
instead of an ``asyncio.Event``, a path without escapes or a query is not parsed again, and
no timer is armed or cancelled per request (one sweeper per worker keeps every deadline,
keep-alive included). Against uvicorn's own protocol that was 40 us of a request's CPU.

The limits of :class:`~rankgate.app.serving.connections.ConnectionLimits` are kept where the bytes
arrive:

- the head (request line and headers) may hold ``max_header_bytes`` and ``max_headers``;
  past either the client gets 431 and the connection is closed, before the bytes are parsed
  further, so a 200 MB header costs at most the limit in memory;
- a request's headers must be complete within ``header_timeout`` of the connection opening
  or of the first byte after the previous response, and its body within ``body_timeout`` of
  its headers (slowloris, slow uploads): 408, then the connection is closed; a connection
  that never sends a byte is closed silently, and an idle keep-alive connection after
  ``keepalive_timeout``;
- a worker holds at most ``max_connections`` at once. A connection past the cap takes the
  place of the connection that has waited longest without a request in flight (an idle
  keep-alive, a socket that never sent a byte, a head still trickling in), which is closed,
  sparing only those younger than ``eviction_grace`` (their request may be on its way): a
  flood of idle or slow sockets cannot lock anyone out. When every connection has a request
  in flight, a few more (``reserve``) are let in for ``/health`` and ``/ready`` alone, so the
  orchestrator's probes still answer under a full cap; anything else there, or past those, is
  answered 503 and closed.

The protocol also tells the app when a client leaves: every request's scope holds a
:class:`~rankgate.app.serving.connections.DisconnectNotice`, fired when the connection is lost or
refused before the response is complete (uvicorn tells only a ``receive`` that is waiting, which
would cost a task per request to keep waiting). Every answer given here is OpenAI error JSON,
like the app's, including a request that is not HTTP (400).

Two writers go past ``send`` for the hot paths (:class:`WholeAnswer`, :class:`ChunkWriter`):
each writes the bytes ``send`` would write, and declines whatever ``send`` must handle.
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
import urllib.parse
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

from rankgate.app.errors import ApiError
from rankgate.app.serving.connections import (
    DISCONNECT_NOTICE,
    PEER_WINDOW,
    PROBE_PATHS,
    ConnectionLimits,
    DisconnectNotice,
    PeerWindow,
)

log = logging.getLogger(__name__)

# The bytes a response header name or value may hold without breaking the framing (those
# uvicorn lets through). ``bytes.translate`` deleting them leaves only the offending ones: one
# table lookup a byte, where a regular expression's character class cost ten times that.
_NAME_BYTES = bytes(
    b for b in range(256) if b > 0x1F and b != 0x7F and b not in b'()<>@,;:[]={} \\"'
)
_VALUE_BYTES = bytes(b for b in range(256) if b == 0x09 or (b > 0x1F and b != 0x7F))


def bad_header_name(name: bytes) -> bool:
    return bool(name.translate(None, _NAME_BYTES))


def bad_header_value(value: bytes) -> bool:
    return bool(value.translate(None, _VALUE_BYTES))


# Buffered request body past which the connection is not read until the app reads.
HIGH_WATER = 65536
# The scope key of the exchange a request's response goes out on (see ChunkWriter.of).
_EXCHANGE = "rankgate.exchange"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_METHODS = {m: m.decode() for m in (b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS")}


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}


class FlowControl:
    """A connection's paused reading (a large body the app has not read) and writing (a
    socket the client does not drain)."""

    __slots__ = ("_transport", "_writable", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable: asyncio.Event | None = None

    async def drain(self) -> None:
        while self.write_paused:
            if self._writable is None:
                self._writable = asyncio.Event()
            await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._writable is not None:
            self._writable.clear()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._writable is not None:
            self._writable.set()


class Exchange:
    """One request and its response: the ASGI ``receive`` and ``send`` of one request.

    The head of a response sent through ``send`` is held for what follows it: a whole JSON
    answer's body comes in the same loop tick and leaves with it as one write (one TCP
    segment, not two); a head with nothing after it in its tick (a stream's) goes out alone
    at the tick's end.
    """

    __slots__ = (
        "__weakref__",
        "_event",
        "_held",
        "_loop",
        "_pending",
        "body",
        "chunked_encoding",
        "default_headers",
        "disconnected",
        "expected_content_length",
        "flow",
        "keep_alive",
        "more_body",
        "on_response",
        "response_complete",
        "response_started",
        "scope",
        "transport",
        "waiting_for_100_continue",
    )

    def __init__(
        self,
        scope: dict[str, Any],
        transport: asyncio.Transport,
        flow: FlowControl,
        loop: asyncio.AbstractEventLoop,
        default_headers: list[tuple[bytes, bytes]],
        expect_100_continue: bool,
        keep_alive: bool,
        on_response: Callable[[], None],
    ) -> None:
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self._loop = loop
        self.default_headers = default_headers
        self.waiting_for_100_continue = expect_100_continue
        self.keep_alive = keep_alive
        self.on_response = on_response
        self.disconnected = False
        self.body = b""
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None
        self.expected_content_length = 0
        self._held: bytes | None = None
        # Something for ``receive`` to look at: a body part, the body's end, the response's
        # end or the client's. An event for a ``receive`` to wait on is made only when one
        # has nothing to look at: the body is nearly always in when the app first reads.
        self._pending = False
        self._event: asyncio.Event | None = None

    # -- the protocol's side

    def notify(self) -> None:
        self._pending = True
        if self._event is not None:
            self._event.set()

    def client_left(self) -> None:
        """The client is gone before the response was complete: ``send`` drops what follows,
        ``receive`` says so, and the request's :class:`DisconnectNotice` fires."""
        self.disconnected = True
        self.notify()
        notice = self.scope.get(DISCONNECT_NOTICE)
        if notice is not None:
            notice.fire()

    def write(self, data: bytes) -> None:
        """Write ``data``, after the head still held for it."""
        held = self._held
        if held is not None:
            self._held = None
            data = held + data
        self.transport.write(data)

    def _write_held(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self.transport.is_closing():
                self.transport.write(held)

    def close(self) -> None:
        self._write_held()
        self.transport.close()

    def finished(self) -> None:
        """The response has been written whole: the state ``send`` leaves it in."""
        self.response_complete = True
        self.notify()
        if not self.keep_alive:
            self.close()
        self.on_response()

    # -- ASGI

    async def run(self, app: Any) -> None:
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            log.error("Exception in ASGI application", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self.close()
        else:
            if result is not None:
                log.error("ASGI callable should return None, but returned '%s'.", result)
                self.close()
            elif not self.response_started and not self.disconnected:
                log.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                log.error("ASGI callable returned without completing response.")
                self.close()
        finally:
            self.on_response = _nothing

    async def _send_500(self) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": 500,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", b"21"),
                    (b"connection", b"close"),
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def receive(self) -> dict[str, Any]:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            if not self._pending:
                if self._event is None:
                    self._event = asyncio.Event()
                await self._event.wait()
            self._pending = False
            if self._event is not None:
                self._event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body, self.body = self.body, b""
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Mapping[str, Any]) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected 'http.response.start', but got '{kind}'.")
            self._start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected 'http.response.body', but got '{kind}'.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected '{kind}' after the response was complete.")

    def _start(self, status: int, headers: Any) -> None:
        self.response_started = True
        self.waiting_for_100_continue = False
        content = [STATUS_LINE[status]]
        closing = False
        for name, value in (*self.default_headers, *headers):
            if bad_header_name(name):
                raise RuntimeError("Invalid HTTP header name.")
            if bad_header_value(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in [
                token.lower().strip() for token in value.split(b",")
            ]:
                self.keep_alive = False
                closing = True
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not closing:
            content.append(b"connection: close\r\n")
        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status not in (204, 304)
        ):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._held = b"".join(content)
        self._loop.call_soon(self._write_held)

    def _body(self, body: bytes, more_body: bool) -> None:
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
            self._write_held()
        elif self.chunked_encoding:
            framed = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
            if not more_body:
                framed.append(b"0\r\n\r\n")
            if framed:
                self.write(b"".join(framed))
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            if body or self._held is not None:
                self.write(body)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.finished()


def _nothing() -> None:
    pass


def _exchange(scope: Mapping[str, Any]) -> Exchange | None:
    """The exchange answering ``scope``'s request, while it lives; None under another server.
    The scope holds it weakly: the exchange holds the scope, and a strong reference back
    would leave every request's objects to the cyclic collector instead of freeing them when
    the request ends."""
    ref = scope.get(_EXCHANGE)
    return None if ref is None else ref()


class ChunkWriter:
    """Writes a streamed response's chunks straight to the socket, past the ASGI ``send``.

    A streamed token is one chunk, and each passing through ``send`` resumes a coroutine
    per middleware layer and the server's own, to reach the one ``transport.write`` it ends
    in. :meth:`write` makes that write itself, framed as ``send`` frames it, when nothing else
    would happen: the response has started with chunked framing, is not complete, the client
    is connected and the socket takes writes. Otherwise it returns False and the chunk goes
    through ``send``, which waits for the socket to drain, or drops the chunk for a client that
    left, as it always does.
    """

    __slots__ = ("_exchange",)

    def __init__(self, exchange: Any) -> None:
        self._exchange = exchange

    @classmethod
    def of(cls, scope: Mapping[str, Any]) -> ChunkWriter | None:
        """The writer for the response to ``scope``'s request; None under another server.
        Built when a stream asks for it: most responses are not streamed."""
        exchange = _exchange(scope)
        return None if exchange is None else cls(exchange)

    def ready(self) -> bool:
        """Whether :meth:`write` would write now."""
        exchange = self._exchange
        return (
            exchange.chunked_encoding is True
            and not exchange.response_complete
            and not exchange.disconnected
            and not exchange.flow.write_paused
        )

    def write(self, body: bytes) -> bool:
        if not self.ready():
            return False
        self.write_ready(body)
        return True

    def write_ready(self, body: bytes) -> None:
        """Write ``body``, :meth:`ready` having said just now that it may be written."""
        self._exchange.write(b"".join((b"%x\r\n" % len(body), body, b"\r\n")))


# Headers that change how a response is framed or whether its connection stays open.
_FRAMING = frozenset({b"connection", b"transfer-encoding"})


class WholeAnswer:
    """Writes a whole response, head and body, in one write past the ASGI ``send``.

    A JSON answer sent through ``send`` is two messages, each resuming a coroutine per
    middleware layer and the server's own, whose head is then checked, lowered and framed
    header by header. When nothing between the app and the server listens to ``send``
    (:meth:`of` is given the ``send`` the caller holds, and answers None unless it is the
    exchange's own), the same bytes can be written at once, and the exchange left as ``send``
    leaves it. A response this cannot frame the same way (a header ``send`` would refuse or
    that changes the framing, a length that does not match, a paused or closed socket) is left
    to ``send``.
    """

    __slots__ = ("_exchange",)

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange

    @classmethod
    def of(cls, scope: Mapping[str, Any], send: Any) -> WholeAnswer | None:
        exchange = _exchange(scope)
        if exchange is None or send != exchange.send:
            return None
        return cls(exchange)

    def write(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write the response; False (nothing written) when ``send`` must do it instead."""
        exchange = self._exchange
        if (
            exchange.response_started
            or exchange.disconnected
            or exchange.flow.write_paused
            or exchange.scope["method"] == "HEAD"
        ):
            return False
        content = [STATUS_LINE[status]]
        length = -1
        for name, value in (*exchange.default_headers, *headers):
            if name == b"content-length":
                if not value.isdigit():
                    return False
                length = int(value)
            elif name in _FRAMING or name != name.lower():
                return False
            content += (name, b": ", value, b"\r\n")
        if length != len(body):
            return False
        if bad_header_name(b"".join(content[1::4])) or bad_header_value(b"".join(content[3::4])):
            return False
        if not exchange.keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        exchange.response_started = True
        exchange.waiting_for_100_continue = False
        exchange.chunked_encoding = False
        exchange.write(b"".join(content))
        exchange.finished()
        return True


class _HeadTooLarge(Exception):
    pass


class _ProbesOnly(Exception):
    """A request other than a probe on a connection let in past the cap."""


class _BadTarget(Exception):
    """A request target the URL parser refuses."""


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


class Http1Protocol(asyncio.Protocol):
    """One HTTP/1.1 connection; see the module docstring. uvicorn builds one per connection
    from the class :func:`protocol_class` makes for a set of limits."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    # One sweeper per server, keyed by its set of open connections.
    _sweepers: ClassVar[dict[int, set[Any]]] = {}

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.root_path = config.root_path
        self.app_state = app_state
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.parser = httptools.HttpRequestParser(self)
        # Answer a request whose client sent more after asking to close, as uvicorn does.
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.asgi = {"version": config.asgi_version, "spec_version": "2.3"}
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.flow: FlowControl = None  # type: ignore[assignment]
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.pipeline: deque[Exchange] = deque()
        # The request being read, and the exchange answering (or last answered).
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100_continue = False
        self.cycle: Exchange | None = None
        self._reading: Exchange | None = None
        # Limits: the head being read, the deadline of the current phase, refusals.
        self._in_head = True
        self._head_bytes = 0
        self._deadline = 0.0
        self._refused = False
        # Since when this connection has waited without a request in flight, and whether
        # the deadline is its keep-alive one (which its next request's first byte lifts).
        self._waiting_since = 0.0
        self._keeping_alive = False
        # Let in past the cap for the health probes only.
        self._reserved = False
        self._window: PeerWindow | None = None

    # ---- connection --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        self.scheme = "https" if is_ssl(transport) else "http"
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
        self._deadline = self._waiting_since + self.limits.header_timeout
        self._ensure_sweeper()

    def _make_room(self) -> bool:
        """Close the connection waiting longest without a request in flight, or let this one
        in for the probes; False when neither can be done."""
        oldest: Http1Protocol | None = None
        reserved = 0
        # A connection this fresh may have its request on the way, not yet read: it is spared.
        spared = self._waiting_since - self.limits.eviction_grace
        for other in self.connections:
            if other is self or not isinstance(other, Http1Protocol):
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
        self.connections.discard(self)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.client_left()
        if self.flow is not None:
            self.flow.resume_writing()
        if exc is None:
            self.transport.close()
        self.parser = None  # type: ignore[assignment]

    def eof_received(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        try:
            if self._in_head:
                if self._keeping_alive:
                    # The next request has begun: its head has the header deadline.
                    self._keeping_alive = False
                    self._deadline = self.loop.time() + self.limits.header_timeout
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
            # No upgrade is served (no WebSockets, no h2c): the request is answered as plain
            # HTTP/1.1 and the connection then closed, as nothing after its head is read.
            latest = self.pipeline[0] if self.pipeline else self.cycle
            if latest is not None:
                latest.keep_alive = False
            log.info("ignored a request's upgrade to another protocol")
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _HeadTooLarge):
                self._head_too_large()
            elif isinstance(cause, _ProbesOnly):
                self._refuse_busy()
            elif isinstance(cause, _BadTarget):
                self._refuse(400, "Invalid HTTP request target.", "invalid_http")
            else:
                raise
        except httptools.HttpParserError:
            log.info("refused a request that is not valid HTTP/1.1")
            self._refuse(400, "Invalid HTTP request received.", "invalid_http")

    # ---- parser callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 section 5.5 excludes from a value.
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        headers = self.headers
        if len(headers) > self.limits.max_headers:
            raise _HeadTooLarge
        url = self.url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            # A plain path (the usual target): nothing for the URL parser to split.
            raw_path, query = url, b""
        else:
            try:
                parsed = httptools.parse_url(url)
            except httptools.HttpParserInvalidURLError as exc:
                raise _BadTarget from exc
            raw_path, query = parsed.path or b"/", parsed.query or b""
        if self._reserved and raw_path not in PROBE_PATHS:
            raise _ProbesOnly
        self._in_head = False
        self._head_bytes = 0
        self._deadline = self.loop.time() + self.limits.body_timeout
        parser = self.parser
        method = parser.get_method()
        http_version = parser.get_http_version()
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root_path = self.root_path
        if root_path:
            path = root_path + path
            raw_path = root_path.encode("ascii") + raw_path
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": self.asgi,
            "http_version": http_version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "method": _METHODS.get(method) or method.decode("ascii"),
            "root_path": root_path,
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": headers,
            "state": self.app_state.copy(),
            DISCONNECT_NOTICE: DisconnectNotice(),
        }
        if self._window is not None:
            scope[PEER_WINDOW] = self._window
        exchange = Exchange(
            scope,
            self.transport,
            self.flow,
            self.loop,
            self.server_state.default_headers,
            self.expect_100_continue,
            http_version != "1.0" and parser.should_keep_alive(),
            self.on_response_complete,
        )
        scope[_EXCHANGE] = weakref.ref(exchange)
        self._reading = exchange
        previous = self.cycle
        if previous is None or previous.response_complete:
            self.cycle = exchange
            self._start(exchange)
        else:
            # A pipelined request waits for the answer before it.
            self.flow.pause_reading()
            self.pipeline.appendleft(exchange)

    def _start(self, exchange: Exchange) -> None:
        task = self.loop.create_task(exchange.run(self.app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_body(self, body: bytes) -> None:
        exchange = self._reading
        if exchange is None or exchange.response_complete:
            return
        exchange.body += body
        if len(exchange.body) > HIGH_WATER:
            self.flow.pause_reading()
        exchange.notify()

    def on_message_complete(self) -> None:
        exchange = self._reading
        if exchange is not None and not exchange.response_complete:
            exchange.more_body = False
            exchange.notify()
        self._reading = None
        self._in_head = True
        if exchange is not None and exchange is self.cycle and exchange.response_complete:
            # Answered before its body was in (a refusal): the connection now waits for its
            # next request, as it would have from the answer on.
            self._wait_for_next()
        else:
            # The response is the app's to time; the next head's bytes count from here.
            self._deadline = 0.0
        if not self.pipeline:
            # A body over the high-water mark paused reading until the app read it; the
            # connection is read on, so that a client that leaves is seen leaving. (Reading
            # stays paused behind a pipelined request.)
            self.flow.resume_reading()

    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self._reserved:
            # A probe's place past the cap is for one answer.
            self.transport.close()
            return
        self.flow.resume_reading()
        if self.pipeline:
            exchange = self.pipeline.pop()
            self.cycle = exchange
            self._start(exchange)
            return
        if self._in_head:
            self._wait_for_next()

    def _wait_for_next(self) -> None:
        """Start the wait for the next request: the keep-alive deadline, or the header
        deadline for a head already begun."""
        self._waiting_since = now = self.loop.time()
        if self._head_bytes:
            self._deadline = now + self.limits.header_timeout
        else:
            self._keeping_alive = True
            self._deadline = now + self.limits.keepalive_timeout

    def shutdown(self) -> None:
        """Called by the server to begin a graceful shutdown."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.transport.close()
        else:
            cycle.keep_alive = False

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

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
            cycle.client_left()
        if not answered and not self.transport.is_closing():
            self.transport.write(_answer(status, message, code, self.server_state.default_headers))
        self.transport.close()

    def _expire(self) -> None:
        if self._in_head:
            cycle = self.cycle
            if self._head_bytes == 0 and (cycle is None or cycle.response_complete):
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
        cycle = self.cycle
        if cycle is not None and cycle.response_complete:
            # Answered already (refused at its head): a second answer would be unasked for.
            self._refused = True
            self._deadline = 0.0
            self.transport.close()
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
        limits = self.limits
        shortest = min(limits.header_timeout, limits.body_timeout, limits.keepalive_timeout)
        return max(0.05, min(1.0, shortest / 4))


def _sweep(loop: asyncio.AbstractEventLoop, connections: set[Any], key: int, tick: float) -> None:
    now = loop.time()
    for protocol in list(connections):
        if isinstance(protocol, Http1Protocol):
            deadline = protocol._deadline
            if deadline and deadline < now and not protocol.transport.is_closing():
                protocol._expire()
    sweepers = Http1Protocol._sweepers
    if connections and sweepers.get(key) is connections:
        loop.call_later(tick, _sweep, loop, connections, key, tick)
    elif sweepers.get(key) is connections:
        del sweepers[key]


def protocol_class(limits: ConnectionLimits) -> type[Http1Protocol]:
    """The protocol class uvicorn builds one instance of per connection, with ``limits``."""
    return type("Http1Protocol", (Http1Protocol,), {"limits": limits})


def uvicorn_config(app: Any, limits: ConnectionLimits, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration every gateway process serves with: uvloop and
    :class:`Http1Protocol` with ``limits``; ``options`` add the rest.

    uvicorn's proxy-headers middleware is off: it rewrites a request's client address and
    scheme from ``X-Forwarded-*``, and the gateway reads neither, so it was a scan of every
    request's headers for nothing. Nor does a response say ``server: uvicorn``, nor does the
    server log each request: the gateway logs its own line
    (:mod:`rankgate.app.observability.logs`)."""
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=protocol_class(limits),
        timeout_keep_alive=limits.keepalive_timeout,
        proxy_headers=False,
        server_header=False,
        **{"access_log": False, **options},
    )
