"""One gateway process: the app under uvicorn, on its own port or the supervisor's socket.

``rankgate serve`` runs it directly, or as each of the ``--workers`` processes
(:mod:`rankgate.app.serving.workers`).
"""

from __future__ import annotations

import socket

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.app.serving.http1 import uvicorn_config
from rankgate.app.serving.shutdown import BACKSTOP_S, GracefulServer
from rankgate.sidecar import SharedLoadBoard


def serve_worker(
    settings: GatewaySettings,
    sockets: list[socket.socket] | None = None,
    shared_load: SharedLoadBoard | None = None,
    prefill_load: SharedLoadBoard | None = None,
) -> int:
    """Serve until shut down; ``sockets`` and the load boards come from the ``--workers``
    supervisor (:mod:`rankgate.app.serving.workers`). The exit status: 1 when startup failed."""
    app = create_app(settings, shared_load=shared_load, prefill_load=prefill_load)
    config = uvicorn_config(
        app,
        settings.connections,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=int(settings.shutdown_grace + BACKSTOP_S),
    )
    server = GracefulServer(config, app.gateway_state.shutdown)
    server.run(sockets=sockets)
    # uvicorn returns normally when startup fails; report that as a failure.
    return 0 if server.started else 1
