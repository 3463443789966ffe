"""The gateway's HTTP/1.1 server: ``httptools`` parsing straight into ASGI, with limits.

uvicorn runs the process (sockets, signals, lifespan, graceful shutdown) and builds one
:class:`Http1Protocol` per connection, the class :func:`uvicorn_config` names. The protocol
is uvicorn's httptools protocol in what the app sees (the same scope, messages and framing)
and does less per request: the request's state is one
:class:`~rankgate.app.serving.http1_exchange.Exchange` with plain flags instead of an
``asyncio.Event``, a path without escapes or a query is not parsed again, and
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

The protocol is this module; one request's ``receive`` and ``send`` are
:mod:`~rankgate.app.serving.http1_exchange`, what it reads of a head beyond the parser's
callbacks and the refusals raised inside them :mod:`~rankgate.app.serving.http1_head`, and
the writers past ``send`` with the protocol's own answers
:mod:`~rankgate.app.serving.http1_writers`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.parse
import weakref
from collections import deque
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

from rankgate.app.serving.connections import (
    DISCONNECT_NOTICE,
    PEER_WINDOW,
    PROBE_PATHS,
    ConnectionLimits,
    DisconnectNotice,
    PeerWindow,
)
from rankgate.app.serving.http1_exchange import EXCHANGE, Exchange, FlowControl
from rankgate.app.serving.http1_head import (
    METHODS,
    BadTarget,
    HeadTooLarge,
    ProbesOnly,
    split_target,
)
from rankgate.app.serving.http1_writers import refusal

log = logging.getLogger(__name__)

# Buffered request body past which the connection is not read until the app reads.
HIGH_WATER = 65536


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
                        raise HeadTooLarge
                    data = data[allowed:]
                else:
                    self._head_bytes += len(data)
            self.parser.feed_data(data)
        except HeadTooLarge:
            self._head_too_large()
        except ProbesOnly:
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
            if isinstance(cause, HeadTooLarge):
                self._head_too_large()
            elif isinstance(cause, ProbesOnly):
                self._refuse_busy()
            elif isinstance(cause, BadTarget):
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
            raise HeadTooLarge
        url = self.url
        if url[:1] == b"/" and b"?" not in url and b"#" not in url:
            # A plain path (the usual target): nothing for the URL parser to split.
            raw_path, query = url, b""
        else:
            raw_path, query = split_target(url)
        if self._reserved and raw_path not in PROBE_PATHS:
            raise ProbesOnly
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
            "method": METHODS.get(method) or method.decode("ascii"),
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
        scope[EXCHANGE] = weakref.ref(exchange)
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
            self.transport.write(refusal(status, message, code, self.server_state.default_headers))
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
