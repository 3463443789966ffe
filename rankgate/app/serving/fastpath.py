"""Direct dispatch of the hot POST endpoints, ahead of routing and dependency resolution.

The OpenAI POST routes take only the raw ``Request`` and do their own decoding, so FastAPI's
path matching and dependency solving add per-request CPU and nothing else. This middleware
sends those paths straight to their handlers and maps any error the one way
``rankgate.app.errors`` defines. Each is one :class:`HotRoute`, from which both this
middleware's table and the route's FastAPI registration (for /openapi.json and for any request
this middleware does not take) come; :func:`check_bare` holds the registration to asking
FastAPI for nothing but the request, so a dependency cannot run in one way in and not the other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
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


@dataclass(frozen=True, slots=True)
class HotRoute:
    """A POST route served by :class:`FastPath`, declared once: the FastAPI registration
    (for /openapi.json and the requests the fast path does not take) and the fast path's
    table both come from it. ``openapi``: the operation's ``openapi_extra`` and
    ``responses``, since FastAPI cannot infer a body the handler decodes itself."""

    path: str
    handler: Handler
    summary: str
    openapi: Mapping[str, Any]


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

    def serve_directly(self, routes: Iterable[HotRoute]) -> dict[str, Handler]:
        """Register each route with FastAPI, on the app itself, and serve it through
        :class:`FastPath`, added here as the innermost user middleware so that all added later
        still run first. Returns the fast path's table (path: handler).

        Raises :class:`NotBare` for a route FastAPI would run with more than the request: a
        dependency of the app's (or the handler's), or a parameter it would parse.
        """
        table: dict[str, Handler] = {}
        for route in routes:
            self.add_api_route(
                route.path,
                route.handler,
                methods=["POST"],
                response_class=Response,
                summary=route.summary,
                **route.openapi,
            )
            check_bare(self, route.path, route.handler)
            table[route.path] = route.handler
        self.hot_paths = frozenset(table)
        self.add_middleware(FastPath, routes=table)
        return table

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


class NotBare(TypeError):
    """A fast-path route that FastAPI would run differently from the fast path."""


def check_bare(app: FastAPI, path: str, handler: Handler) -> None:
    """Raise :class:`NotBare` unless FastAPI's POST route for ``path`` calls ``handler`` with
    the request alone: no dependency (the handler's or the app's), no parameter
    FastAPI would parse, no ``Response`` or ``BackgroundTasks`` it would inject."""
    found = [
        route
        for route in app.router.routes
        if isinstance(route, APIRoute) and route.path == path and "POST" in (route.methods or ())
    ]
    if [route.endpoint for route in found] != [handler]:
        raise NotBare(
            f"POST {path} must be registered with FastAPI once, for its fast-path handler"
        )
    needs = _needs(found[0].dependant)
    if needs:
        raise NotBare(f"POST {path} is served by the fast path, which would skip its {needs}")


def _needs(dependant: Dependant) -> list[str]:
    asked = {
        "dependencies": dependant.dependencies,
        "path parameters": dependant.path_params,
        "query parameters": dependant.query_params,
        "header parameters": dependant.header_params,
        "cookie parameters": dependant.cookie_params,
        "body parameters": dependant.body_params,
        "injected response": dependant.response_param_name,
        "background tasks": dependant.background_tasks_param_name,
        "security scopes": dependant.security_scopes_param_name,
        "connection": dependant.http_connection_param_name,
    }
    needs = [name for name, value in asked.items() if value]
    if dependant.request_param_name is None:
        needs.append("missing request parameter")
    return needs


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
