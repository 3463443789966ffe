"""What a servicer sees of a call on :mod:`rankgate.mocker.h2server`, shaped like grpc.aio's.

The same generated servicers run on grpc.aio and on the mock's own HTTP/2 server; this is the
part of grpc.aio's server API they use: the method table that ``add_*Servicer_to_server``
registers into, and the servicer context (``invocation_metadata``, ``abort``,
``set_code``/``set_details``, ``write``, ``cancelled``, ``done``, ``add_done_callback``,
``peer``, ``time_remaining``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

log = logging.getLogger(__name__)

# Request headers that are transport, not metadata (grpc.aio leaves them out too).
_NOT_METADATA = frozenset(
    ("te", "content-type", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding")
)


@dataclass(frozen=True, slots=True)
class Method:
    """One servable RPC: its handler and how its messages cross the wire."""

    handler: Callable[..., Any]
    parse: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]
    streaming: bool
    # A streaming handler that yields its responses (else it awaits ``context.write``).
    generator: bool = False

    @classmethod
    def from_handler(cls, handler: Any) -> Method | None:
        """From a ``grpc.RpcMethodHandler``; None for client-streaming methods."""
        if handler.request_streaming:
            return None
        parse, serialize = (
            handler.request_deserializer,
            _bytes_as_they_are(handler.response_serializer),
        )
        if handler.response_streaming:
            function = handler.unary_stream
            return cls(function, parse, serialize, True, inspect.isasyncgenfunction(function))
        return cls(handler.unary_unary, parse, serialize, False)


def _bytes_as_they_are(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A handler's serializer that sends a reply already encoded (fault injection) unchanged."""

    def serializer(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return serializer


class CallDetails:
    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata: tuple[tuple[str, str], ...] = ()


class CallConnection(Protocol):
    """The connection a call's stream belongs to, as its context uses it."""

    @property
    def peer(self) -> str: ...

    async def send_message(self, stream: Any, payload: bytes) -> None: ...


class CallStream(Protocol):
    """The stream carrying a call, as its context sees it."""

    @property
    def conn(self) -> CallConnection: ...
    @property
    def method(self) -> Method: ...
    @property
    def path(self) -> str: ...
    @property
    def ended(self) -> bool: ...
    @property
    def reset(self) -> bool: ...
    @property
    def deadline(self) -> float | None: ...


class Aborted(Exception):
    """Raised by :meth:`ServicerContext.abort`; ends the call with the recorded status."""


# ---------------------------------------------------------------- one call


class ServicerContext:
    """What a servicer sees of its call, shaped like grpc.aio's ``ServicerContext``."""

    __slots__ = (
        "_callbacks",
        "_code",
        "_details",
        "_headers",
        "_stream",
        "_trailing",
    )

    def __init__(self, stream: CallStream, headers: list[tuple[str, str]]) -> None:
        self._stream = stream
        self._headers = headers
        self._code = grpc.StatusCode.OK
        self._details = ""
        self._trailing: tuple[tuple[str, str | bytes], ...] = ()
        self._callbacks: list[Callable[[ServicerContext], object]] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        metadata: list[tuple[str, str | bytes]] = []
        for name, value in self._headers:
            if name[0] == ":" or name in _NOT_METADATA:
                continue
            if name.endswith("-bin"):
                try:
                    metadata.append((name, base64.b64decode(value + "=" * (-len(value) % 4))))
                except binascii.Error:
                    continue
            else:
                metadata.append((name, value))
        return tuple(metadata)

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        if code is grpc.StatusCode.OK:
            raise ValueError("abort() needs a status code other than OK")
        self._code = code
        if details or not self._details:
            self._details = details
        if trailing_metadata:
            self._trailing = trailing_metadata
        raise Aborted(details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self._trailing = tuple(metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    async def write(self, message: Any) -> None:
        """Send one response message (server-streaming handlers that do not ``yield``)."""
        stream = self._stream
        if stream.ended:
            raise asyncio.CancelledError()
        await stream.conn.send_message(stream, stream.method.serialize(message))

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        # Response headers are fixed; a servicer here never sends its own.
        del metadata

    def cancelled(self) -> bool:
        return self._stream.reset

    def done(self) -> bool:
        return self._stream.ended

    def add_done_callback(self, callback: Callable[[ServicerContext], object]) -> None:
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def peer(self) -> str:
        return self._stream.conn.peer

    def time_remaining(self) -> float | None:
        deadline = self._stream.deadline
        if deadline is None:
            return None
        return max(0.0, deadline - time.monotonic())

    def _run_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:
                log.exception("done callback of %s failed", self._stream.path)
