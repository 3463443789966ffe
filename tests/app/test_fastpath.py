"""The two OpenAI POST routes enter the app at its outermost ``add_middleware`` layer, past
the framework's own layers; every other request still takes the whole stack."""

from __future__ import annotations

from typing import Any

import httpx

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.auth import AccessConfig
from rankgate.app.server import create_app
from rankgate.app.serving.clients import ClientWatch
from rankgate.app.serving.fastpath import FastPathApp
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
