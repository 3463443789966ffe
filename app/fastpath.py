"""Direct dispatch of the two hot endpoints, ahead of routing and dependency resolution.

The OpenAI POST routes take only the raw ``Request`` and do their own decoding, so FastAPI's
path matching and dependency solving add per-request CPU and nothing else. This middleware
sends those two paths straight to their handlers and maps any error the one way
``app.errors`` defines; the routes stay registered on the app for /openapi.json and for any
request this middleware does not take.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import as_api_error

Handler = Callable[[Request], Awaitable[Response]]


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
