"""Run an app under uvicorn on loopback in a background thread, as a client would see it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from rankgate.app.serving.connections import ConnectionLimits
from rankgate.app.serving.http1 import uvicorn_config
from tests.support.ports import free_port


@contextmanager
def serve_app(
    app: Any,
    timeout: float = 60.0,
    connections: ConnectionLimits | None = None,
    http: str | None = None,
) -> Iterator[str]:
    """Serve ``app`` with the gateway's own uvicorn configuration (protocol and limits), or
    with uvicorn's own ``http`` protocol (``"httptools"``) for a reference to compare with."""
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
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the gateway failed to start; see the log above")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError("the gateway did not start in time")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
