"""Input limits through HTTP: body size (declared and chunked), JSON depth, and the context
window, each a 4xx that says what is wrong, with nothing sent to the engine."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import httpx
import msgspec
import orjson
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.limits import ENGINE_JSON_DEPTH, ENGINE_JSON_NODES, InputLimits, check_depth
from rankgate.app.server import create_app
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.app.test_metrics import value
from tests.conftest import TINY_TOKENIZER
from tests.support.loop_probe import health_probe
from tests.support.polling import wait_until

LIMIT = 64 << 10
DEPTH = 16
JSON = {"content-type": "application/json"}
MB = 1 << 20


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

    response = http.post("/v1/completions", content=chunks(), headers=JSON)
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
        response = http.post("/v1/chat/completions", content=body, headers=JSON)
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


# ---- hostile bodies (issue 18): refused early, with the event loop free --------------------


@pytest.fixture(scope="module")
def roomy() -> Iterator[tuple[str, ScriptedEngine]]:
    """A gateway with the default limits (32 MiB bodies) in front of a scripted engine."""
    engine = ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)
    with serve_app(create_app(GatewaySettings(), engine=engine)) as url:
        yield url, engine


def post(url: str, path: str, body: bytes, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as client:
        return client.post(path, content=body, headers={**JSON, **headers})


def test_brackets_then_an_unterminated_escaped_string_are_refused_at_once(
    roomy: tuple[str, ScriptedEngine],
) -> None:
    url, _ = roomy
    body = b'{"model":"scripted","messages":' + b"[" * 100 + b'"' + b'\\"' * 300_000
    with health_probe(url) as probe:
        response = post(url, "/v1/chat/completions", body)
    assert response.status_code == 400
    assert error_of(response)["code"] == "json_too_deep"
    assert probe.max_latency < 1.0


@pytest.mark.parametrize(
    ("inner", "code"),
    [
        (b",".join([b"[[],[[]],[[[]]]]"] * (30 * MB // 17)), "json_too_complex"),
        (b",".join([b"1"] * (2 * MB)), "json_too_complex"),
        (b"[" * 200 + b"]" * 200, "json_too_deep"),
    ],
    ids=["30MB-of-small-arrays", "2M-items", "deep"],
)
def test_a_pass_through_field_cannot_hold_the_loop(
    roomy: tuple[str, ScriptedEngine], inner: bytes, code: str
) -> None:
    url, engine = roomy
    before = len(engine.requests)
    body = (
        b'{"model":"scripted","prompt":"hi","max_tokens":1,"kv_transfer_params":{"x":['
        + inner
        + b"]}}"
    )
    with health_probe(url) as probe:
        response = post(url, "/v1/completions", body)
    assert response.status_code in (400, 413), response.text
    assert error_of(response)["code"] == code
    assert len(engine.requests) == before
    assert probe.max_latency < 1.0, probe.max_latency
    assert post(url, "/v1/completions", orjson.dumps(completion_body())).status_code == 200


def completion_body(**extra: object) -> dict[str, object]:
    return {"model": SCRIPTED_MODEL, "prompt": "hi", "max_tokens": 1, **extra}


def test_kv_transfer_params_must_fit_the_engines_protobuf_decoder(
    roomy: tuple[str, ScriptedEngine],
) -> None:
    url, engine = roomy

    def objects(depth: int) -> object:
        value: object = 1
        for _ in range(depth):
            value = {"a": value}
        return value

    before = len(engine.requests)
    # 34 levels of objects is past upb's MaxDepth; 17 is past the gateway's engine limit.
    for depth in (34, ENGINE_JSON_DEPTH + 1):
        response = post(
            url, "/v1/completions", orjson.dumps(completion_body(kv_transfer_params=objects(depth)))
        )
        assert response.status_code == 400, response.text
        assert error_of(response)["param"] == "kv_transfer_params"
        assert error_of(response)["code"] == "json_too_deep"
    wide = completion_body(kv_transfer_params={"ids": list(range(ENGINE_JSON_NODES + 1))})
    response = post(url, "/v1/completions", orjson.dumps(wide))
    assert response.status_code == 400
    assert error_of(response)["code"] == "json_too_complex"
    assert len(engine.requests) == before
    fits = completion_body(kv_transfer_params=objects(ENGINE_JSON_DEPTH))
    assert post(url, "/v1/completions", orjson.dumps(fits)).status_code == 200
    assert engine.requests[-1].kv_transfer_params == objects(ENGINE_JSON_DEPTH)


def deep_text(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c1", "function": {"name": "f", "arguments": deep_text(900)}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "done"},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"guided_json": deep_text(900)}, "guided_json"),
        ({"structured_outputs": {"json": deep_text(70)}}, "structured_outputs.json"),
    ],
    ids=["tool-call-arguments", "guided_json", "structured_outputs.json"],
)
def test_deep_json_inside_a_string_is_a_400_naming_the_field(
    roomy: tuple[str, ScriptedEngine], fields: dict[str, object], param: str
) -> None:
    url, engine = roomy
    before = len(engine.requests)
    response = post(url, "/v1/chat/completions", orjson.dumps(chat_body(**fields)))
    assert response.status_code == 400, response.text
    assert error_of(response)["code"] == "json_too_deep"
    assert error_of(response)["param"] == param
    assert len(engine.requests) == before


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/jsonx"],
)  # fmt: skip
def test_post_bodies_must_be_declared_json(
    roomy: tuple[str, ScriptedEngine], content_type: str | None
) -> None:
    url, engine = roomy
    before = len(engine.requests)
    headers = {} if content_type is None else {"content-type": content_type}
    with httpx.Client(base_url=url, timeout=30) as client:
        for path in ("/v1/chat/completions", "/v1/completions"):
            body = chat_body() if "chat" in path else completion_body()
            response = client.post(path, content=orjson.dumps(body), headers=headers)
            assert response.status_code == 415, response.text
            assert error_of(response)["code"] == "unsupported_media_type"
            assert "application/json" in str(error_of(response)["message"])
    assert len(engine.requests) == before


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "Application/JSON; charset=utf-8", "application/vnd.x+json"],
)
def test_json_media_types_are_accepted(
    roomy: tuple[str, ScriptedEngine], content_type: str
) -> None:
    url, _ = roomy
    response = post(
        url, "/v1/completions", orjson.dumps(completion_body()), **{"content-type": content_type}
    )
    assert response.status_code == 200, response.text


def test_a_client_that_hangs_up_during_its_upload_is_a_499_not_a_500(
    roomy: tuple[str, ScriptedEngine], caplog: pytest.LogCaptureFixture
) -> None:
    url, engine = roomy
    host, port = url.removeprefix("http://").split(":")
    before = len(engine.requests)
    with httpx.Client(base_url=url, timeout=30) as client:
        metrics_before = client.get("/metrics").text
    name = "rankgate_http_requests_total"
    with caplog.at_level(logging.INFO), httpx.Client(base_url=url, timeout=30) as client:
        scraped = [metrics_before]

        def scrape() -> str:
            scraped.append(client.get("/metrics").text)
            return scraped[-1]

        def begun(text: str) -> float:
            """Requests answered, then those in flight (one finishing between is missed)."""
            return value(text, name, endpoint="completions") + value(
                text, "rankgate_http_requests_in_flight"
            )

        def hang_up_during_upload(requests: float) -> None:
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                    b"content-type: application/json\r\ncontent-length: 100000\r\n\r\n"
                    b'{"model":"scripted","prompt":"'
                )
                # The request has begun, its body still coming, when its client hangs up.
                wait_until(
                    lambda: begun(scrape()) >= requests,
                    10,
                    lambda: f"the upload did not begin a request: {scraped[-1]}",
                )

        for i in range(1, 4):
            hang_up_during_upload(begun(metrics_before) + i)

        def gone() -> float:
            return value(scraped[-1], name, status="499") - value(
                metrics_before, name, status="499"
            )

        def counted() -> bool:
            scrape()
            return gone() >= 3

        wait_until(counted, 10, lambda: f"{gone()} of 3 hang-ups counted as 499")
    after = scraped[-1]
    assert gone() == 3
    assert value(after, name, status="500") == value(metrics_before, name, status="500")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if r.exc_info]
    assert len(engine.requests) == before


@pytest.fixture(scope="module")
def long_context() -> Iterator[str]:
    """A gateway whose engine takes prompts of millions of tokens: long texts are tokenized."""
    info = msgspec.structs.replace(scripted_info(TINY_TOKENIZER), max_model_len=1 << 24)
    engine = ScriptedEngine(info, TINY_TOKENIZER)
    with serve_app(create_app(GatewaySettings(), engine=engine)) as url:
        yield url


@pytest.mark.parametrize("where", ["content", "reasoning_content", "tool-description", "prompt"])
def test_long_texts_are_tokenized_without_holding_the_loop(long_context: str, where: str) -> None:
    # Words no earlier test sent, so the tokenizer's cache of repeated pieces cannot answer.
    text = " ".join(f"{where}{i * 7919 % 10007}" for i in range(4 * MB // 16))
    path = "/v1/chat/completions"
    if where == "content":
        body = chat_body(messages=[{"role": "user", "content": text}], max_tokens=1)
    elif where == "reasoning_content":
        body = chat_body(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok", "reasoning_content": text},
                {"role": "user", "content": "again"},
            ],
            max_tokens=1,
        )
    elif where == "tool-description":
        tool = {"type": "function", "function": {"name": "f", "description": text}}
        body = chat_body(tools=[tool], max_tokens=1)
    else:
        path, body = "/v1/completions", completion_body(prompt=text)
    with health_probe(long_context) as probe:
        started = time.perf_counter()
        response = post(long_context, path, orjson.dumps(body))
        elapsed = time.perf_counter() - started
    assert response.status_code == 200, response.text[:300]
    # Tokenized on the loop, 4 MB keep a poll waiting for most of the request (70-90% of it);
    # off the loop, polls are answered throughout (under 10%). Measured against the request's
    # own time, so a machine slowed by other work slows both sides alike.
    assert probe.polls > 2
    assert probe.max_latency < elapsed / 2, (probe.max_latency, elapsed)


def test_a_text_no_context_can_hold_is_refused_without_tokenizing(
    roomy: tuple[str, ScriptedEngine],
) -> None:
    url, engine = roomy
    before = len(engine.requests)
    text = "lorem ipsum " * (4 * MB // 12)
    started = time.monotonic()
    for path, body in (
        ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": text}])),
        ("/v1/completions", completion_body(prompt=text)),
    ):
        response = post(url, path, orjson.dumps(body))
        assert response.status_code == 400
        assert error_of(response)["code"] == "context_length_exceeded"
        assert "characters" in str(error_of(response)["message"])
    # Tokenizing these 8 MB would take the tiny tokenizer many seconds.
    assert time.monotonic() - started < 5
    assert len(engine.requests) == before
