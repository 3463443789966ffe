"""Input limits through HTTP: body size (declared and chunked), JSON depth, and the context
window, each a 4xx that says what is wrong, with nothing sent to the engine."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.limits import InputLimits, check_depth
from app.server import create_app
from app.settings import GatewaySettings
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER

LIMIT = 64 << 10
DEPTH = 16


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)


@pytest.fixture(scope="module")
def http(engine: ScriptedEngine) -> Iterator[httpx.Client]:
    settings = GatewaySettings(limits=InputLimits(max_body_bytes=LIMIT, max_json_depth=DEPTH))
    with (
        serve_app(create_app(settings, engine=engine)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def nested(depth: int) -> object:
    """``depth`` nested arrays around 1 (for bodies that json= can still encode)."""
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def error_of(response: httpx.Response) -> dict[str, object]:
    error: dict[str, object] = response.json()["error"]
    return error


def test_declared_oversized_body_is_413(http: httpx.Client, engine: ScriptedEngine) -> None:
    before = len(engine.requests)
    response = http.post(
        "/v1/chat/completions",
        content=b'{"model":"' + b"x" * LIMIT + b'"}',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"
    assert str(LIMIT) in str(error_of(response)["message"])
    assert len(engine.requests) == before
    assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_chunked_oversized_body_is_413_without_reading_it_all(http: httpx.Client) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        for _ in range(1024):
            sent += 8192
            yield b" " * 8192

    response = http.post("/v1/completions", content=chunks())
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"
    assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_nesting_past_the_limit_is_400_naming_it(
    http: httpx.Client, engine: ScriptedEngine
) -> None:
    before = len(engine.requests)
    for depth in (DEPTH + 1, 5000):
        body = (
            b'{"model":"scripted","messages":[{"role":"user","content":"hi"}],'
            b'"kv_transfer_params":{"x":' + b"[" * depth + b"1" + b"]" * depth + b"}}"
        )
        response = http.post("/v1/chat/completions", content=body)
        assert response.status_code == 400, response.text
        assert error_of(response)["code"] == "json_too_deep"
    assert len(engine.requests) == before
    ok = http.post("/v1/chat/completions", json=chat_body(kv_transfer_params={"x": nested(8)}))
    assert ok.status_code == 200


def test_brackets_inside_strings_are_not_nesting(http: httpx.Client) -> None:
    text = '[{"\\"' * 200
    response = http.post("/v1/chat/completions", json=chat_body(user=text, max_tokens=4))
    assert response.status_code == 200, response.text


def test_prompt_longer_than_the_context_window_never_reaches_the_engine(
    http: httpx.Client, engine: ScriptedEngine
) -> None:
    before = len(engine.requests)
    long = "word " * 400  # > max_model_len 256 tokens of the scripted engine
    chat = http.post(
        "/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": long}])
    )
    assert chat.status_code == 400
    assert error_of(chat)["code"] == "context_length_exceeded"
    assert error_of(chat)["param"] == "messages"
    completion = http.post("/v1/completions", json={"model": SCRIPTED_MODEL, "prompt": long})
    assert completion.status_code == 400
    assert error_of(completion)["param"] == "prompt"
    assert len(engine.requests) == before


def test_unknown_field_is_refused_like_openai(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(temprature=0.5))
    assert response.status_code == 400
    assert error_of(response)["param"] == "temprature"
    assert "Unrecognized request argument" in str(error_of(response)["message"])


@pytest.mark.parametrize(
    ("body", "depth", "deep"),
    [
        (b'{"a":[[[1]]]}', 4, False),
        (b'{"a":[[[[1]]]]}', 4, True),
        (b'{"a":"[[[[[[[[[["}', 4, False),
        (b'{"a":"\\"[[[[[[","b":[]}', 4, False),
        (b"[" * 10 + b"]" * 10, 9, True),
    ],
)
def test_depth_check(body: bytes, depth: int, deep: bool) -> None:
    if deep:
        with pytest.raises(Exception, match="deeper than"):
            check_depth(body, depth)
    else:
        check_depth(body, depth)
