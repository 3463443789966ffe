"""Direct dispatch of the two hot endpoints, ahead of routing and dependency resolution.

The OpenAI POST routes take only the raw ``Request`` and do their own decoding, so FastAPI's
path matching and dependency solving add per-request CPU and nothing else. This middleware
sends those two paths straight to their handlers and maps any error the one way
``app.errors`` defines; the routes stay registered on the app for /openapi.json and for any
request this middleware does not take.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import as_api_error

Handler = Callable[[Request], Awaitable[Response]]
# How deep the framework's own layers may wrap the operator-visible middleware.
_MAX_FRAMEWORK_LAYERS = 16


class FastPathApp(FastAPI):
    """A FastAPI app whose hot paths enter at its outermost ``add_middleware`` layer.

    Starlette and FastAPI wrap the middleware stack in layers of their own (server-error
    page, telemetry, body limit) that re-wrap ``send`` and cost CPU on every request and every
    streamed chunk. The hot routes need none of them: :class:`FastPath` turns every error into
    the API's JSON error itself, and ``app.limits`` bounds the body. Everything added with
    ``add_middleware`` (API keys, CORS, client liveness) still runs, in the same order.
    """

    hot_paths: frozenset[str] = frozenset()
    _hot_entry: ASGIApp | None = None

    def serve_directly(self, paths: Iterable[str]) -> None:
        self.hot_paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.hot_paths:
            entry = self._hot_entry or self._find_hot_entry()
            if entry is not None:
                scope["app"] = self
                await entry(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _find_hot_entry(self) -> ASGIApp | None:
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        classes: set[object] = {middleware.cls for middleware in self.user_middleware}
        layer: ASGIApp | None = self.middleware_stack
        for _ in range(_MAX_FRAMEWORK_LAYERS):
            if layer is None:
                return None
            if type(layer) in classes:
                self._hot_entry = layer
                return layer
            layer = getattr(layer, "app", None)
        return None


class FastPath:
    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.routes.get(scope["path"])
            if handler is not None:
                request = Request(scope, receive)
                try:
                    response = await handler(request)
                except Exception as exc:
                    response = as_api_error(exc).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
