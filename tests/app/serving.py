"""Run an app under uvicorn on loopback in a background thread, as a client would see it."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
import uvloop

from rankgate.app.serving.connections import ConnectionLimits
from rankgate.app.serving.http1 import uvicorn_config
from tests.support.ports import free_port


@contextmanager
def serve_app(
    app: Any,
    timeout: float = 60.0,
    connections: ConnectionLimits | None = None,
    http: str | None = None,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> Iterator[str]:
    """Serve ``app`` with the gateway's own uvicorn configuration (protocol and limits), or
    with uvicorn's own ``http`` protocol (``"httptools"``) for a reference to compare with;
    on a loop from ``loop_factory`` when given (one whose clock a test moves)."""
    port = free_port()
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "log_level": "warning",
        "lifespan": "on",
    }
    if http is None:
        config = uvicorn_config(app, connections or ConnectionLimits(), **options)
    else:
        config = uvicorn.Config(
            app, http=http, loop="uvloop", server_header=False, proxy_headers=False, **options
        )
    server = _Server(config, loop_factory)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    if not server.settled.wait(timeout):
        server.should_exit = True
        raise TimeoutError("the gateway did not start in time")
    if not server.started:
        raise RuntimeError("the gateway failed to start; see the log above")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


class _Server(uvicorn.Server):
    """A uvicorn server that says when its startup is over, having started or not."""

    def __init__(
        self, config: uvicorn.Config, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None
    ) -> None:
        super().__init__(config)
        self.settled = threading.Event()
        self._loop_factory = loop_factory

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.settled.set()

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            if self._loop_factory is None:
                super().run(sockets)
            else:
                with asyncio.Runner(loop_factory=self._loop_factory) as runner:
                    runner.run(self.serve(sockets))
        finally:
            self.settled.set()


class SkewedLoop(uvloop.Loop):
    """uvloop's loop with a clock a test moves on: what the gateway's connections read as
    the time (their deadlines, how long each has waited), while its timers keep real time."""

    skew = 0.0

    def time(self) -> float:
        return float(super().time()) + self.skew
