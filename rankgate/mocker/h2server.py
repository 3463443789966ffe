"""gRPC over HTTP/2, served on the event loop itself: the mock engine's default transport.

Why not grpcio: every message grpc.aio sends crosses threads (the servicer's task hands it to
C-core, whose threads write the socket and report back through a poller that wakes the loop),
which costs more CPU per streamed message than the engine spends making it. This server is
the server role of the gateway's sans-IO HTTP/2 core (:mod:`rankgate.wire.h2`, the only thing it
shares with the gateway): ``data_received`` feeds the core (:mod:`rankgate.mocker.h2_connection`),
each call runs as one task with a context shaped like grpc.aio's
(:mod:`rankgate.mocker.servicer_context`), and what every call produced during one loop iteration
goes out in a single ``transport.write``.

It serves unary-request methods (unary and server-streaming responses) registered the way
generated ``add_*Servicer_to_server`` functions register them, so the same servicers run on
either server. This module is the listener and its lifecycle: registration, start, and a stop
that refuses new calls and drains the running ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

from rankgate.mocker.h2_connection import MAX_CONCURRENT_STREAMS, Connection
from rankgate.mocker.servicer_context import CallDetails, Method


class H2Server:
    """Serves registered gRPC methods on one listening socket, on the running loop."""

    def __init__(
        self, *, max_message: int, max_concurrent_streams: int = MAX_CONCURRENT_STREAMS
    ) -> None:
        self.max_message = max_message
        self.max_concurrent_streams = max_concurrent_streams
        self.connections: set[Connection] = set()
        self._methods: dict[str, Method] = {}
        self._generic: list[Any] = []
        self._listener: asyncio.Server | None = None
        self._stopping = False
        self._stopped = asyncio.Event()
        self._idle: asyncio.Event | None = None

    # -- registration, as generated ``add_*Servicer_to_server`` functions call it

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        for name, handler in handlers.items():
            method = Method.from_handler(handler)
            if method is not None:
                self._methods[f"/{service}/{name}"] = method

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self._generic.extend(handlers)

    def resolve(self, path: str) -> Method | None:
        method = self._methods.get(path)
        if method is not None or not self._generic:
            return method
        for generic in self._generic:
            handler = generic.service(CallDetails(path))
            if handler is not None:
                return Method.from_handler(handler)
        return None

    # -- lifecycle

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a port); returns the port bound."""
        loop = asyncio.get_running_loop()
        bind = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        self._listener = await loop.create_server(
            lambda: Connection(self), bind or None, port, reuse_address=True, backlog=1024
        )
        sockets = self._listener.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls (GOAWAY), let running ones finish within ``grace`` seconds (None:
        none), then cancel the rest and close every connection."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if self._listener is not None:
            self._listener.close()
        connections = list(self.connections)
        for conn in connections:
            conn.go_away()
        if grace:
            self._idle = asyncio.Event()
            if any(conn.active for conn in connections):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), grace)
        tasks: list[asyncio.Task[None]] = []
        for conn in list(self.connections):
            tasks.extend(conn.abort_all())
        if tasks:
            await asyncio.wait(tasks)
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._listener.wait_closed(), 1.0)
            self._listener = None
        self._stopped.set()

    def wake_stop(self) -> None:
        """A draining connection finished its last stream."""
        if self._idle is not None and not any(conn.active for conn in self.connections):
            self._idle.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


__all__ = ["H2Server"]
