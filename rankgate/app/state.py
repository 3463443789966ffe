"""What the routes and middleware share for the app's lifetime, as one typed object.

Starlette's ``app.state`` is an untyped bag: a misspelt name is found by the first request that
reads it, and every read on the hot path goes through a ``__getattr__``. :class:`GatewayState`
is built whole by :func:`rankgate.app.server.create_app`, held as a plain attribute of the app,
and reached through :func:`state_of`: one attribute, its fields slots, no fallback lookups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from rankgate.app.serving.fastpath import FastPathApp

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from rankgate.app.edge.limits import InputLimits
    from rankgate.app.gateway import Gateway
    from rankgate.app.observability.metrics import GatewayMetrics
    from rankgate.app.observability.record import RequestObserver
    from rankgate.app.observability.tracing import Tracing
    from rankgate.app.response_store import ResponseStore
    from rankgate.app.serving.shutdown import Shutdown


@dataclass(slots=True, eq=False)
class GatewayState:
    """``gateway`` is None until startup has discovered the engine and loaded its tokenizer,
    and again once shutdown is done; ``demo``: the bundled mock engine serves, not a vLLM."""

    registry: CollectorRegistry
    metrics: GatewayMetrics
    observer: RequestObserver
    limits: InputLimits
    responses: ResponseStore
    shutdown: Shutdown
    started_at: int
    demo: bool
    affinity_header: bytes | None
    tracing: Tracing | None
    gateway: Gateway | None = None


class GatewayApp(FastPathApp):
    """The app, holding its :class:`GatewayState`."""

    def __init__(self, state: GatewayState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gateway_state = state


def state_of(request: Request) -> GatewayState:
    state: GatewayState = request.app.gateway_state
    return state
