"""Direct dispatch of the two hot endpoints, ahead of routing and dependency resolution.

The OpenAI POST routes take only the raw ``Request`` and do their own decoding, so FastAPI's
path matching and dependency solving add per-request CPU and nothing else. This middleware
sends those two paths straight to their handlers and maps any error the one way
``rankgate.app.errors`` defines; the routes stay registered on the app for /openapi.json and for any
request this middleware does not take.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from rankgate.app.errors import as_api_error
from rankgate.app.respond.document import JsonDocument
from rankgate.app.serving.clients import WHOLE_ANSWER

Handler = Callable[[Request], Awaitable[Response]]
# Responses whose body is whole when the handler returns: written in one write when the
# client watch can (``rankgate.app.serving.clients.WHOLE_ANSWER``), else sent as two ASGI messages.
_WHOLE = frozenset({Response, JsonDocument})


class FastPathApp(FastAPI):
    """A FastAPI app whose hot paths enter at its outermost ``add_middleware`` layer.

    Starlette and FastAPI wrap the middleware stack in layers of their own (server-error
    page, telemetry, body limit) that re-wrap ``send`` and cost CPU on every request and every
    streamed chunk. The hot routes need none of them: :class:`FastPath` turns every error into
    the API's JSON error itself, and ``rankgate.app.edge.limits`` bounds the body. Everything added
    with ``add_middleware`` (API keys, CORS, client liveness) still runs, in the same order.

    The entry is the outermost user middleware as the framework builds it: its factory is
    wrapped, for the build, in one that keeps the instance it makes.
    """

    hot_paths: frozenset[str] = frozenset()
    _hot_entry: ASGIApp | None = None

    def serve_directly(self, paths: Iterable[str]) -> None:
        self.hot_paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.hot_paths:
            if self.middleware_stack is None:
                self.middleware_stack = self.build_middleware_stack()
            entry = self._hot_entry
            if entry is not None:
                scope["app"] = self
                await entry(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        user = self.user_middleware
        if not user:
            return super().build_middleware_stack()
        outermost = user[0]

        def keep_entry(app: ASGIApp, *args: Any, **kwargs: Any) -> ASGIApp:
            entry: ASGIApp = outermost.cls(app, *args, **kwargs)
            self._hot_entry = entry
            return entry

        self.user_middleware = [Middleware(keep_entry, *outermost.args, **outermost.kwargs)]
        self.user_middleware += user[1:]
        try:
            return super().build_middleware_stack()
        finally:
            self.user_middleware = user


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
                watched = scope.get(WHOLE_ANSWER)
                if (
                    watched is not None
                    and send == watched.send
                    and type(response) in _WHOLE
                    and response.background is None
                    and watched.answer(response.status_code, response.raw_headers, response.body)
                ):
                    return
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
