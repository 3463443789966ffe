"""The hot OpenAI POST routes enter the app at its outermost ``add_middleware`` layer, past
the framework's own layers; every other request still takes the whole stack. Each is declared
once, and one FastAPI would run with more than the request is refused."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import Depends, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.auth import AccessConfig
from rankgate.app.server import HOT_ROUTES, create_app
from rankgate.app.serving.clients import ClientWatch
from rankgate.app.serving.fastpath import FastPathApp, Handler, HotRoute, NotBare
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER

CHAT = {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _engine() -> ScriptedEngine:
    return ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)


def test_hot_routes_enter_at_the_outermost_operator_middleware() -> None:
    app: Any = create_app(GatewaySettings(), engine=_engine())
    assert isinstance(app, FastPathApp)
    with serve_app(app) as url, httpx.Client(base_url=url) as http:
        answer = http.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        # The outermost user middleware (client liveness) is where hot requests start.
        assert isinstance(app._hot_entry, ClientWatch)
        # ... the very instance the framework's stack runs, not a second copy of it.
        layers: list[Any] = [app.middleware_stack]
        while len(layers) < 16 and hasattr(layers[-1], "app"):
            layers.append(layers[-1].app)
        assert any(layer is app._hot_entry for layer in layers)
        outermost: object = app.user_middleware[0].cls
        assert outermost is ClientWatch
        # Errors on the hot routes are still the API's JSON errors.
        broken = http.post(
            "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
        )
        assert broken.status_code == 400
        assert broken.json()["error"]["code"] == "invalid_json"
        streamed = http.post(
            "/v1/completions", json={"model": CHAT["model"], "prompt": "x", "stream": True, "n": 0}
        )
        assert streamed.status_code == 400
        assert streamed.json()["error"]["param"] == "n"
        # Other routes keep the framework's stack: its 404 and its method checks.
        assert http.get("/v1/models").status_code == 200
        assert http.get("/v1/chat/completions").status_code == 405
        assert http.get("/no/such/route").status_code == 404


def test_api_keys_still_guard_the_hot_routes() -> None:
    access = AccessConfig(api_keys=("secret-key",))
    app = create_app(GatewaySettings(access=access), engine=_engine())
    with serve_app(app) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 401
        keyed = http.post(
            "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer secret-key"}
        )
        assert keyed.status_code == 200, keyed.text


def test_each_hot_route_is_served_directly_and_registered_with_fastapi_once() -> None:
    app = create_app(GatewaySettings(), engine=_engine())
    assert app.hot_paths == {route.path for route in HOT_ROUTES}
    assert len(HOT_ROUTES) == 3
    for route in HOT_ROUTES:
        posts = [
            each
            for each in app.routes
            if isinstance(each, APIRoute)
            and each.path == route.path
            and "POST" in (each.methods or ())
        ]
        assert [each.endpoint for each in posts] == [route.handler]
        assert posts[0].summary == route.summary


async def _answer(request: Request) -> Response:
    return Response(b"{}")


async def _with_query(request: Request, limit: int = 1) -> Response:
    return Response(b"{}")


def _check() -> None:
    """A dependency the fast path would never call."""


async def _with_dependency(request: Request, checked: None = Depends(_check)) -> Response:
    return Response(b"{}")


def _hot(handler: Handler = _answer) -> HotRoute:
    return HotRoute("/v1/hot", handler, summary="Hot", openapi={})


def test_a_bare_hot_route_is_served_and_documented() -> None:
    app = FastPathApp()
    assert app.serve_directly([_hot()]) == {"/v1/hot": _answer}
    assert app.hot_paths == {"/v1/hot"}
    assert app.openapi()["paths"]["/v1/hot"]["post"]["summary"] == "Hot"


@pytest.mark.parametrize(
    ("app", "handler", "refused"),
    [
        (FastPathApp(dependencies=[Depends(_check)]), _answer, "dependencies"),
        (FastPathApp(), _with_dependency, "dependencies"),
        (FastPathApp(), _with_query, "query parameters"),
    ],
    ids=["app dependency", "handler dependency", "handler parameter"],
)
def test_a_hot_route_fastapi_would_run_with_more_than_the_request_is_refused(
    app: FastPathApp, handler: Handler, refused: str
) -> None:
    with pytest.raises(NotBare, match=refused):
        app.serve_directly([_hot(handler)])
    assert app.hot_paths == frozenset()


def test_a_hot_route_registered_twice_is_refused() -> None:
    app = FastPathApp()
    app.add_api_route("/v1/hot", _answer, methods=["POST"])
    with pytest.raises(NotBare, match="once"):
        app.serve_directly([_hot()])
