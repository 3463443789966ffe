"""The request's head through HTTP: every field it reads reaches the engine request as sent,
every malformed value is the 4xx it always was (status, code, ``param``, message), and when
a request has several faults the one answered is the one the route meets first."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.auth import AccessConfig
from rankgate.app.edge.head import read_head
from rankgate.app.edge.limits import InputLimits
from rankgate.app.errors import ApiError
from rankgate.app.server import create_app
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER

KEYS = ("key-a", "key-b")
LIMIT = 4096
MADE_UP = re.compile(r"[0-9a-f]{24}")
ID_RULE = "header 'x-request-id' must be 1 to 128 characters from A-Z, a-z, 0-9 and '._:@/+=-'"
RANK_RULE = "header 'x-data-parallel-rank' must be a non-negative decimal integer, got "


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)


@pytest.fixture(scope="module")
def http(engine: ScriptedEngine) -> Iterator[httpx.Client]:
    settings = GatewaySettings(
        access=AccessConfig(api_keys=KEYS),
        affinity_header="X-Session-Id",
        limits=InputLimits(max_body_bytes=LIMIT),
    )
    with (
        serve_app(create_app(settings, engine=engine)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


def tenant(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


A, B = tenant("key-a"), tenant("key-b")


def body_of(path: str, **fields: Any) -> bytes:
    if path == "/v1/completions":
        body = {"model": SCRIPTED_MODEL, "prompt": "hi", "max_tokens": 2}
    elif path == "/v1/responses":
        body = {"model": SCRIPTED_MODEL, "input": "hi", "max_output_tokens": 2}
    else:
        body = {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return orjson.dumps({**body, **fields})


def post(
    http: httpx.Client,
    path: str,
    headers: dict[str, Any],
    key: str = "key-a",
    content: bytes | None = None,
    **fields: Any,
) -> httpx.Response:
    sent = {"authorization": f"Bearer {key}", "content-type": "application/json", **headers}
    sent = {name: value for name, value in sent.items() if value is not None}
    if content is None:
        content = body_of(path, **fields)
    return http.post(path, content=content, headers=sent)


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


# ---- what the head reads, as the engine request carries it ------------------------------


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    ("headers", "key", "fields", "seen"),
    [
        ({}, "key-a", {}, {"rank": None, "affinity": None}),
        ({"x-data-parallel-rank": "1"}, "key-a", {}, {"rank": 1}),
        ({"x-data-parallel-rank": "0"}, "key-a", {}, {"rank": 0}),
        ({"x-data-parallel-rank": "2147483647"}, "key-a", {}, {"rank": 2**31 - 1}),
        ({"x-data-parallel-rank": "007"}, "key-a", {}, {"rank": 7}),
        # The session header names the conversation, scoped to the key's tenant.
        ({"x-session-id": "conv-1"}, "key-a", {}, {"affinity": f"{A}:conv-1"}),
        ({"x-session-id": "conv-1"}, "key-b", {}, {"affinity": f"{B}:conv-1"}),
        (
            {"x-session-id": "conv-1"},
            "key-a",
            {"prompt_cache_key": "other"},
            {"affinity": f"{A}:conv-1"},
        ),
        ({}, "key-b", {"prompt_cache_key": "pk"}, {"affinity": f"{B}:pk"}),
        # An empty session names nothing: the body's key speaks.
        ({"x-session-id": ""}, "key-a", {"prompt_cache_key": "pk"}, {"affinity": f"{A}:pk"}),
        ({"content-type": "Application/JSON; charset=utf-8"}, "key-a", {}, {"rank": None}),
        ({"content-type": "application/vnd.x+json"}, "key-a", {}, {"rank": None}),
    ],
)  # fmt: skip
def test_the_head_reaches_the_engine_request(
    http: httpx.Client,
    engine: ScriptedEngine,
    path: str,
    headers: dict[str, str],
    key: str,
    fields: dict[str, Any],
    seen: dict[str, Any],
) -> None:
    before = len(engine.requests)
    response = post(http, path, headers, key, **fields)
    assert response.status_code == 200, response.text
    assert len(engine.requests) == before + 1
    sent = engine.requests[-1]
    for name, expected in seen.items():
        if name == "affinity" and path == "/v1/responses" and expected is None:
            # A Responses request is its own chain: its key is the response's id.
            assert sent.affinity is not None
            assert sent.affinity.startswith(f"{tenant(key)}:resp_")
            continue
        assert getattr(sent, name) == expected, name


@pytest.mark.parametrize("path", ROUTES)
def test_a_client_request_id_names_the_answer_and_the_engine_request(
    http: httpx.Client, engine: ScriptedEngine, path: str
) -> None:
    response = post(http, path, {"x-request-id": "client-7:a/b+c=d@e.f_g-h"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "client-7:a/b+c=d@e.f_g-h"
    assert engine.requests[-1].request_id.startswith("client-7:a/b+c=d@e.f_g-h-")


@pytest.mark.parametrize("path", ROUTES)
def test_without_a_request_id_one_is_made_up_and_used_throughout(
    http: httpx.Client, engine: ScriptedEngine, path: str
) -> None:
    response = post(http, path, {})
    assert response.status_code == 200, response.text
    made_up = response.headers["x-request-id"]
    assert MADE_UP.fullmatch(made_up)
    assert engine.requests[-1].request_id == made_up


# ---- what the head refuses: the same error as always, and nothing sent -------------------


def _id_error(value: Any) -> tuple[dict[str, Any], tuple[int, str | None, str | None, str]]:
    return {"x-request-id": value}, (400, "invalid_request_id", "x-request-id", ID_RULE)


def _rank_error(value: Any, shown: str) -> tuple[dict[str, Any], tuple[int, None, str, str]]:
    return {"x-data-parallel-rank": value}, (400, None, "x-data-parallel-rank", RANK_RULE + shown)


def _type_error(value: Any, shown: str) -> tuple[dict[str, Any], tuple[int, str, None, str]]:
    message = (
        f"Unsupported content type {shown}: send the body as JSON with "
        "'Content-Type: application/json'."
    )
    return {"content-type": value}, (415, "unsupported_media_type", None, message)


REFUSED = [
    _id_error("bad id"),
    _id_error(""),
    _id_error("a" * 129),
    _id_error("semi;colon"),
    _id_error(b"caf\xe9"),
    _rank_error("one", "'one'"),
    _rank_error("", "''"),
    _rank_error("+1", "'+1'"),
    _rank_error("-0", "'-0'"),
    _rank_error("1.0", "'1.0'"),
    _rank_error("0x1", "'0x1'"),
    _rank_error("2147483648", "'2147483648'"),
    _rank_error("9" * 40, "'" + "9" * 29 + "'..."),
    _rank_error(b"\xb2", "'\\xb2'"),
    _rank_error("\u0663".encode(), "'\\xd9\\xa3'"),
    _type_error(None, "none"),
    _type_error("text/plain", "'text/plain'"),
    _type_error("application/jsonx", "'application/jsonx'"),
    _type_error("multipart/form-data; boundary=x", "'multipart/form-data; boundary=x'"),
]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(("headers", "expected"), REFUSED)
def test_a_malformed_head_is_refused_as_before(
    http: httpx.Client,
    engine: ScriptedEngine,
    path: str,
    headers: dict[str, Any],
    expected: tuple[int, str | None, str | None, str],
) -> None:
    before = len(engine.requests)
    response = post(http, path, headers)
    status, code, param, message = expected
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["message"]) == (code, param, message)
    assert error["type"] == "invalid_request_error"
    assert response.headers["x-request-id"]
    assert len(engine.requests) == before


@pytest.mark.parametrize("path", ROUTES)
def test_a_body_declared_over_the_limit_is_a_413(http: httpx.Client, path: str) -> None:
    response = post(http, path, {}, content=b" " * (LIMIT + 1))
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("request_too_large", None)
    assert error["message"] == f"The request body exceeds {LIMIT} bytes."


# ---- several faults: the one the route meets first is the one answered ------------------

BAD_ID = {"x-request-id": "bad id"}
BAD_RANK = {"x-data-parallel-rank": "one"}
NO_TYPE = {"content-type": None}


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    ("headers", "fields", "status", "param"),
    [
        ({**BAD_ID, **BAD_RANK, **NO_TYPE}, {}, 400, "x-request-id"),
        ({**BAD_RANK, **NO_TYPE}, {}, 415, None),
        (BAD_RANK, {"model": "no-such-model"}, 404, "model"),
        # The body is decoded before the header's pin is read, and the pin before the
        # body's pin is compared with it.
        (BAD_RANK, {"data_parallel_rank": "1"}, 400, "data_parallel_rank"),
        (BAD_RANK, {"data_parallel_rank": 1}, 400, "x-data-parallel-rank"),
    ],
)
def test_the_first_fault_met_is_the_one_answered(
    http: httpx.Client,
    path: str,
    headers: dict[str, Any],
    fields: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    response = post(http, path, headers, **fields)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ROUTES)
def test_a_refused_rank_is_answered_under_the_bodys_request_id(
    http: httpx.Client, path: str
) -> None:
    response = post(http, path, BAD_RANK, request_id="from-the-body")
    assert response.status_code == 400, response.text
    assert response.headers["x-request-id"] == "from-the-body"


# ---- the parse itself, on raw ASGI headers ------------------------------------------------


def scope(*headers: tuple[bytes, bytes], state: dict[str, Any] | None = None) -> dict[str, Any]:
    built: dict[str, Any] = {"type": "http", "headers": list(headers)}
    if state is not None:
        built["state"] = state
    return built


@pytest.mark.parametrize(
    ("raw", "declared"),
    [
        (None, None),
        (b"0", 0),
        (b"4096", 4096),
        (b"12345678901234567890", 12345678901234567890),
        (b"", None),
        (b"-1", None),
        (b"1e3", None),
        (b" 12", None),
        (b"\xb2", None),
    ],
)
def test_the_declared_length_is_a_decimal_number_or_none(
    raw: bytes | None, declared: int | None
) -> None:
    headers = [] if raw is None else [(b"content-length", raw)]
    assert read_head(scope(*headers), None).declared_length == declared


def test_the_first_of_repeated_headers_wins() -> None:
    head = read_head(
        scope(
            (b"x-request-id", b"first"),
            (b"x-request-id", b"second"),
            (b"x-data-parallel-rank", b"1"),
            (b"x-data-parallel-rank", b"one"),
            (b"x-session-id", b"s1"),
            (b"x-session-id", b"s2"),
            (b"content-type", b"application/json"),
            (b"content-type", b"text/plain"),
        ),
        b"x-session-id",
    )
    assert (head.request_id, head.client_named, head.id_refused) == ("first", True, None)
    assert (head.pinned_rank(), head.session, head.content_type) == (1, "s1", "application/json")


def test_the_session_is_read_only_from_the_operators_header_and_the_tenant_from_the_scope() -> None:
    raw = scope((b"x-session-id", b"s1"), state={"rankgate_tenant": b"\x01\x02"})
    assert read_head(raw, None).session is None
    assert read_head(raw, b"x-session-id").session == "s1"
    assert read_head(raw, None).tenant == b"\x01\x02"
    assert read_head(scope(), None).tenant is None
    assert read_head(scope(state={}), None).tenant is None


def test_a_refused_rank_is_raised_only_when_the_pin_is_asked_for() -> None:
    head = read_head(scope((b"x-data-parallel-rank", b"one")), None)
    assert head.rank is None
    with pytest.raises(ApiError) as refused:
        head.pinned_rank()
    assert refused.value is head.rank_refused
    assert (refused.value.status, refused.value.param) == (400, "x-data-parallel-rank")
