"""Writers that go past the ASGI ``send`` for the hot paths, and the connection's own answers.

:class:`ChunkWriter` (a streamed token) and :class:`WholeAnswer` (a whole JSON answer) each
write the bytes ``send`` would write, and decline whatever ``send`` must handle. :func:`refusal`
is the answer :class:`~rankgate.app.serving.http1.Http1Protocol` gives when it refuses a
request itself (a limit, bytes that are not HTTP): OpenAI error JSON, like the app's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rankgate.app.errors import ApiError
from rankgate.app.serving.http1_exchange import (
    STATUS_LINE,
    Exchange,
    bad_header_name,
    bad_header_value,
    exchange_of,
)


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
        exchange = exchange_of(scope)
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
        exchange = exchange_of(scope)
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


def refusal(status: int, message: str, code: str, default_headers: list[Any]) -> bytes:
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
