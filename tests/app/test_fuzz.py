"""Property-based and schema-driven fuzzing through HTTP: no input may produce a 5xx or hang.

schemathesis generates valid and invalid requests for every operation of our own
/openapi.json against a gateway in front of the mock engine (the real sidecar path), and
hypothesis throws request-shaped JSON (known fields with values of any type, unknown fields)
and raw bytes at the two request parsers. Both run a fixed, derandomized number of examples
so CI is deterministic and bounded.

Then one generator per class of hostile input (issue 18): nesting shapes in every free-form
field, string escapes, big bodies (with the event loop's responsiveness checked by a
concurrent /health probe, a property with a generous bound), non-ASCII header bytes, image
URL forms and deep JSON inside strings.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from rankgate.app.edge.limits import ENGINE_JSON_DEPTH, InputLimits
from rankgate.app.schemas.requests import ChatCompletionRequest, CompletionRequest
from rankgate.app.serving.connections import ConnectionLimits
from tests.app.scripted import SCRIPTED_MODEL
from tests.support.loop_probe import health_probe

pytestmark = pytest.mark.timeout(240)
EXAMPLES = {GenerationMode.POSITIVE: 20, GenerationMode.NEGATIVE: 20}
PARSER_EXAMPLES = 150
_BASE = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def fuzz(examples: int) -> settings:
    return settings(_BASE, max_examples=examples)


CASES = {"schemathesis": 0}
JSON = {"content-type": "application/json"}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def _fields(struct: type[msgspec.Struct]) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(struct)]


@pytest.fixture(scope="module")
def mock_http(mock_gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mock_gateway, timeout=60) as client:
        yield client


def test_schemathesis_finds_no_5xx(mock_gateway: str) -> None:
    schema = schemathesis.openapi.from_url(f"{mock_gateway}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    for operation in operations:
        for mode, count in EXAMPLES.items():
            strategy = operation.as_strategy(generation_mode=mode)

            @fuzz(count)
            @given(case=strategy)
            def run(case: Any) -> None:
                CASES["schemathesis"] += 1
                response = case.call(base_url=mock_gateway, timeout=30)
                assert response.status_code < 500, (
                    f"{case.method} {case.formatted_path} {case.body!r}: "
                    f"{response.status_code} {response.text[:300]}"
                )

            try:
                run()
            except Unsatisfiable:
                # Nothing to make invalid (a GET without parameters): only positive cases.
                assert mode is GenerationMode.NEGATIVE, operation.path
    print(f"\nschemathesis cases run: {CASES['schemathesis']}")
    assert CASES["schemathesis"] >= 80


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"]
        assert error["type"]


@fuzz(PARSER_EXAMPLES)
@given(
    fields=st.dictionaries(
        st.sampled_from([*_fields(ChatCompletionRequest), "frobnicate"]), json_values, max_size=5
    ),
    content=st.one_of(st.text(max_size=60), json_values),
)
def test_chat_parser_answers_every_shape_with_a_4xx_or_an_answer(
    scripted_http: httpx.Client, fields: dict[str, Any], content: Any
) -> None:
    body = {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **fields,
    }
    _check(
        scripted_http.post("/v1/chat/completions", content=json.dumps(body).encode(), headers=JSON)
    )


@fuzz(PARSER_EXAMPLES)
@given(
    fields=st.dictionaries(
        st.sampled_from([*_fields(CompletionRequest), "frobnicate"]), json_values, max_size=5
    ),
)
def test_completion_parser_answers_every_shape_with_a_4xx_or_an_answer(
    scripted_http: httpx.Client, fields: dict[str, Any]
) -> None:
    body = {"model": SCRIPTED_MODEL, "prompt": "hi", "max_tokens": 4, **fields}
    _check(scripted_http.post("/v1/completions", content=json.dumps(body).encode(), headers=JSON))


@fuzz(PARSER_EXAMPLES)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_raw_bytes_are_a_4xx(scripted_http: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = scripted_http.post(path, content=raw, headers=JSON)
        assert 400 <= response.status_code < 500, response.text[:300]


# ---- hostile input, one generator per class -----------------------------------------------

HOSTILE_EXAMPLES = 60
BIG_EXAMPLES = 8
DEPTH = InputLimits().max_json_depth
# Generous: the rule is 100 ms on a quiet machine; this suite shares two cores with others.
LOOP_BOUND_S = 1.0


def nest(depth: int, shape: list[str], leaf: Any) -> Any:
    """``leaf`` inside ``depth`` containers, arrays or objects as ``shape`` cycles."""
    value = leaf
    for level in range(depth):
        value = [value] if shape[level % len(shape)] == "a" else {"k": value}
    return value


# Where a client can put any JSON, and how deep that spot already is in the body.
FREE_FORM: dict[str, tuple[int, Any]] = {
    "kv_transfer_params": (2, lambda v: {"kv_transfer_params": {"x": v}}),
    "chat_template_kwargs": (2, lambda v: {"chat_template_kwargs": {"x": v}}),
    "tools.parameters": (
        6,
        lambda v: {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "x": v}},
                }
            ]
        },
    ),
    "response_format.schema": (
        4,
        lambda v: {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"x": v}},
            }
        },
    ),
    "guided_json": (2, lambda v: {"guided_json": {"x": v}}),
}


def _hostile_check(response: httpx.Response) -> dict[str, Any] | None:
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        error: dict[str, Any] = response.json()["error"]
        assert error["message"]
        assert error["type"]
        return error
    return None


def _post_json(http: httpx.Client, path: str, body: bytes, **headers: Any) -> httpx.Response:
    return http.post(path, content=body, headers={**JSON, **headers})


def _chat_fields(**fields: Any) -> dict[str, Any]:
    return {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **fields,
    }


@fuzz(HOSTILE_EXAMPLES)
@given(
    where=st.sampled_from(sorted(FREE_FORM)),
    depth=st.integers(min_value=0, max_value=3 * DEPTH),
    shape=st.lists(st.sampled_from("ao"), min_size=1, max_size=4),
    leaf=st.sampled_from([1, "s", None, [], {}, "[[[[", '"\\"']),
)
def test_nesting_shapes_in_free_form_fields_are_refused_by_depth(
    scripted_http: httpx.Client, where: str, depth: int, shape: list[str], leaf: Any
) -> None:
    above, place = FREE_FORM[where]
    body = json.dumps(_chat_fields(**place(nest(depth, shape, leaf)))).encode()
    inner = depth + (1 if leaf in ([], {}) else 0)
    total = above + inner
    # kv_transfer_params must also fit the engine's protobuf decoder.
    engine_deep = where == "kv_transfer_params" and 1 + inner > ENGINE_JSON_DEPTH
    error = _hostile_check(_post_json(scripted_http, "/v1/chat/completions", body))
    if total > DEPTH or engine_deep:
        assert error is not None, total
        assert error["code"] == "json_too_deep", (total, error)
    else:
        assert error is None or error["code"] != "json_too_deep", (total, error)


escaped_text = st.text(
    alphabet=st.sampled_from(['"', "\\", "[", "]", "{", "}", ",", ":", "a", "é", "\n", "\x00"]),
    max_size=300,
)


@fuzz(HOSTILE_EXAMPLES)
@given(text=escaped_text, field=st.sampled_from(["content", "user", "stop", "name"]))
def test_string_escapes_are_text_however_they_nest(
    scripted_http: httpx.Client, text: str, field: str
) -> None:
    if field == "content":
        fields: dict[str, Any] = {"messages": [{"role": "user", "content": text or "x"}]}
    elif field == "name":
        fields = {"messages": [{"role": "user", "content": "x", "name": text}]}
    else:
        fields = {field: text or "x"}
    for ensure_ascii in (True, False):
        body = json.dumps(_chat_fields(**fields), ensure_ascii=ensure_ascii).encode()
        error = _hostile_check(_post_json(scripted_http, "/v1/chat/completions", body))
        assert error is None or error["code"] != "json_too_deep", error


def _big_body(kind: str, size: int) -> tuple[str, bytes]:
    if kind == "small-arrays":
        inner = b",".join([b"[[],[[]],[[[]]]]"] * (size // 17))
        return "/v1/completions", (
            b'{"model":"scripted","prompt":"hi","max_tokens":1,"kv_transfer_params":{"x":['
            + inner
            + b"]}}"
        )
    if kind == "items":
        return "/v1/completions", json.dumps(
            {"model": SCRIPTED_MODEL, "prompt": [1] * (size // 2), "max_tokens": 1}
        ).encode()
    if kind == "escapes":
        text = '\u00e9"' * (size // 8)
        return "/v1/chat/completions", (
            b'{"model":"scripted","max_tokens":1,"messages":[{"role":"user","content":"'
            + text.encode()
            + b'"}]}'
        )
    if kind == "message":
        return "/v1/chat/completions", json.dumps(
            _chat_fields(messages=[{"role": "user", "content": "lorem ipsum " * (size // 12)}])
        ).encode()
    if kind == "tool-description":
        tool = {"type": "function", "function": {"name": "f", "description": "d " * (size // 2)}}
        return "/v1/chat/completions", json.dumps(_chat_fields(tools=[tool])).encode()
    if kind == "reasoning":
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "reasoning_content": "t " * (size // 2)},
            {"role": "user", "content": "again"},
        ]
        return "/v1/chat/completions", json.dumps(_chat_fields(messages=messages)).encode()
    assert kind == "messages"
    many = [{"role": "user", "content": "m"}] * (size // 30)
    return "/v1/chat/completions", json.dumps(_chat_fields(messages=many)).encode()


@fuzz(BIG_EXAMPLES)
@given(
    kind=st.sampled_from(
        ["small-arrays", "items", "escapes", "message", "tool-description", "reasoning", "messages"]
    ),
    megabytes=st.integers(min_value=1, max_value=16),
)
def test_big_bodies_never_hold_the_event_loop(
    scripted_gateway: str, kind: str, megabytes: int
) -> None:
    path, body = _big_body(kind, megabytes << 20)
    with (
        httpx.Client(base_url=scripted_gateway, timeout=120) as http,
        health_probe(scripted_gateway) as probe,
    ):
        _hostile_check(_post_json(http, path, body))
    assert probe.failures == 0
    assert probe.max_latency < LOOP_BOUND_S, (kind, megabytes, probe.max_latency)


@fuzz(HOSTILE_EXAMPLES)
@given(
    name=st.sampled_from(
        [b"x-data-parallel-rank", b"x-request-id", b"authorization", b"x-other", b"content-type"]
    ),
    raw=st.binary(min_size=1, max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    high=st.binary(min_size=1, max_size=4).map(lambda b: bytes(c | 0x80 for c in b)),
)
def test_non_ascii_header_bytes_are_a_4xx_or_an_answer(
    scripted_gateway: str, name: bytes, raw: bytes, high: bytes
) -> None:
    """Any byte but CR and LF in a header value (sent raw: HTTP clients refuse to send
    control characters) is a JSON 4xx or an answer, from the HTTP layer or from the app."""
    body = json.dumps(_chat_fields()).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
        + (b"" if name == b"content-type" else b"content-type: application/json\r\n")
        + name + b": " + raw + high + b"\r\n"
        + b"content-length: %d\r\n\r\n" % len(body)
    )  # fmt: skip
    host, port = scripted_gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    status = int(status_line.split(b" ")[1])
    assert status < 500, data[:300]
    if status >= 400:
        payload = rest.partition(b"\r\n\r\n")[2]
        if b"transfer-encoding: chunked" in rest.lower():
            payload = payload.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
        error = json.loads(payload)["error"]
        assert error["message"]
        if name == b"x-data-parallel-rank" and error.get("code") != "invalid_http":
            assert error["param"] == "x-data-parallel-rank"


_HOSTS = st.sampled_from(
    [
        "[::1", "[::1]", "[1::2::3]", "[v1.x]", "[::127.0.0.1]", "[fec0::1]", "[::ffff:7f00:1]",
        "0177.0.0.01", "0x7f.1", "2130706433", "127.1", "0", "\u2488", "xn--",
        "\uff11\uff12\uff17.\uff10.\uff10.\uff11",
        "a..b", ".", "%41", "a b", "-a-", "\ud800", "[fe80::1%25eth0]", "images.invalid",
        "1.2.3.4:99999", "1.2.3.4:0", "user:pw@[::1]", "@", "",
    ]
)  # fmt: skip


@fuzz(HOSTILE_EXAMPLES)
@given(
    scheme=st.sampled_from(["http://", "https://", "HTTP://", "ftp://", "file://", "data:"]),
    host=_HOSTS | st.text(max_size=12),
    path=st.sampled_from(["", "/", "/a.png", "/%zz", "/\x7f"]),
)
def test_image_url_forms_are_a_4xx(
    mock_http: httpx.Client, scheme: str, host: str, path: str
) -> None:
    url = scheme + host + path
    content = [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": url or "x"}},
    ]
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": content}]}
    error = _hostile_check(
        _post_json(
            mock_http, "/v1/chat/completions", json.dumps({**body, "max_tokens": 1}).encode()
        )
    )
    assert error is not None, url


@fuzz(HOSTILE_EXAMPLES)
@given(
    where=st.sampled_from(["arguments", "guided_json", "structured_outputs"]),
    depth=st.integers(min_value=1, max_value=1200),
    shape=st.lists(st.sampled_from("ao"), min_size=1, max_size=3),
)
def test_deep_json_inside_strings_is_refused_by_depth(
    scripted_http: httpx.Client, where: str, depth: int, shape: list[str]
) -> None:
    text = json.dumps(nest(depth, shape, 1)) if depth < 900 else _deep_text(depth, shape)
    if where == "arguments":
        call = {"id": "c", "function": {"name": "f", "arguments": text}}
        fields: dict[str, Any] = {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ]
        }
    elif where == "guided_json":
        fields = {"guided_json": text}
    else:
        fields = {"structured_outputs": {"json": text}}
    body = json.dumps(_chat_fields(**fields)).encode()
    error = _hostile_check(_post_json(scripted_http, "/v1/chat/completions", body))
    if depth > DEPTH:
        assert error is not None, depth
        assert error["code"] == "json_too_deep", (depth, error)


def _deep_text(depth: int, shape: list[str]) -> str:
    opens = "".join("[" if shape[i % len(shape)] == "a" else '{"k":' for i in range(depth))
    closes = "".join("]" if shape[i % len(shape)] == "a" else "}" for i in reversed(range(depth)))
    return opens + "1" + closes


CONNECTIONS = ConnectionLimits()


def _raw_exchange(gateway: str, data: bytes) -> tuple[int, bytes]:
    host, port = gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        with contextlib.suppress(OSError):  # refused mid-send: the answer is already there
            sock.sendall(data)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split(b" ")[1]), rest


@fuzz(HOSTILE_EXAMPLES)
@given(
    count=st.integers(min_value=0, max_value=CONNECTIONS.max_headers + 20),
    size=st.integers(min_value=0, max_value=CONNECTIONS.max_header_bytes // 48),
    big=st.integers(min_value=0, max_value=CONNECTIONS.max_header_bytes + 4096),
)
def test_header_size_and_count_decide_431(
    scripted_gateway: str, count: int, size: int, big: int
) -> None:
    """Many headers, long headers, one huge header: 431 exactly when the head passes a
    limit, else the app's answer."""
    body = json.dumps(_chat_fields()).encode()
    fixed = [
        b"host: gateway",
        b"connection: close",
        b"content-type: application/json",
        b"content-length: %d" % len(body),
    ]
    extra = [b"x-f%d: %s" % (i, b"v" * size) for i in range(count)]
    if big:
        extra.append(b"x-big: " + b"b" * big)
    lines = [b"POST /v1/chat/completions HTTP/1.1", *fixed, *extra]
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    over = (
        len(head) > CONNECTIONS.max_header_bytes
        or len(fixed) + len(extra) > CONNECTIONS.max_headers
    )
    status, rest = _raw_exchange(scripted_gateway, head + body)
    assert (status == 431) == over, (status, len(head), len(fixed) + len(extra))
    if over:
        assert b"headers_too_large" in rest


@fuzz(HOSTILE_EXAMPLES)
@given(
    prompts=st.integers(min_value=1, max_value=256),
    n=st.integers(min_value=1, max_value=128),
    tokens=st.booleans(),
)
def test_fan_out_is_capped_per_request(
    scripted_http: httpx.Client, prompts: int, n: int, tokens: bool
) -> None:
    prompt: Any = [[1, 2, 3]] * prompts if tokens else [f"p{i}" for i in range(prompts)]
    if prompts == 1:
        prompt = prompt[0]
    body = {"model": SCRIPTED_MODEL, "prompt": prompt, "n": n, "max_tokens": 1}
    error = _hostile_check(_post_json(scripted_http, "/v1/completions", json.dumps(body).encode()))
    if prompts * n > InputLimits().max_fanout:
        assert error is not None
        assert error["code"] == "too_many_choices"
    else:
        assert error is None or error["code"] != "too_many_choices"
