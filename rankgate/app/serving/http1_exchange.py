"""One HTTP/1.1 request and its response, as the ASGI app sees them.

:class:`Exchange` is the ``receive`` and ``send`` of one request on a connection of
:class:`~rankgate.app.serving.http1.Http1Protocol`: the same messages and framing as uvicorn's
httptools protocol, with the request's state in plain flags instead of an ``asyncio.Event``.
:class:`FlowControl` is its connection's paused reading and writing. The status lines and the
header checks here are the framing every response head gets, whoever writes it (``send``,
:mod:`rankgate.app.serving.http1_writers`).
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Callable, Mapping
from typing import Any

from rankgate.app.serving.connections import DISCONNECT_NOTICE

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


# The scope key of the exchange a request's response goes out on (see exchange_of).
EXCHANGE = "rankgate.exchange"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


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


def exchange_of(scope: Mapping[str, Any]) -> Exchange | None:
    """The exchange answering ``scope``'s request, while it lives; None under another server.
    The scope holds it weakly: the exchange holds the scope, and a strong reference back
    would leave every request's objects to the cyclic collector instead of freeing them when
    the request ends."""
    ref = scope.get(EXCHANGE)
    return None if ref is None else ref()
