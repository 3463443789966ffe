"""Every client mistake is a 4xx with OpenAI's error JSON naming the field; never a 500. Every
exception type a request can end with answers as the table here lists."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import msgspec
import orjson
import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import rankgate.sidecar
from rankgate.app.errors import (
    ANSWERED,
    ApiError,
    as_api_error,
    client_gone,
    invalid,
    model_not_found,
    response_not_found,
    unsupported,
)
from rankgate.multimodal import MediaError, MediaOverBudget
from rankgate.sidecar import (
    BadEngineResponse,
    DiscoveryError,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    FailedPrecondition,
    GatewayOverloaded,
    InvalidRequest,
    NotFound,
    SidecarError,
)
from rankgate.sidecar.errors import KvLeaseExpired
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SCRIPTED_MODEL, "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": SCRIPTED_MODEL, "prompt": "hi", **fields}


CHAT_CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("missing messages", {"model": SCRIPTED_MODEL}, 400, "messages"),
    ("missing model", {"messages": USER}, 400, "model"),
    ("empty messages", chat(messages=[]), 400, "messages"),
    # Ignored, as vLLM does (tests/app/test_unknown_fields.py has the strict mode's 400s).
    ("unknown field", chat(frobnicate=1), 200, None),
    (
        "unknown message field",
        chat(messages=[{"role": "user", "content": "x", "foo": 1}]),
        200,
        None,
    ),
    ("bad role", chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("content type", chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (
        "part type",
        chat(messages=[{"role": "user", "content": [{"type": "video"}]}]),
        400,
        "messages[0].content[0].type",
    ),
    ("temperature type", chat(temperature="hot"), 400, "temperature"),
    ("temperature range", chat(temperature=2.5), 400, "temperature"),
    ("top_p range", chat(top_p=0), 400, "top_p"),
    ("n range", chat(n=0), 400, "n"),
    ("max_tokens range", chat(max_tokens=0), 400, "max_tokens"),
    ("presence range", chat(presence_penalty=3), 400, "presence_penalty"),
    ("top_logprobs range", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), 400, "top_logprobs"),
    ("logit_bias key", chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias value", chat(logit_bias={"1": 500}), 400, "logit_bias"),
    ("logit_bias vocab", chat(logit_bias={"999999": 1}), 400, "logit_bias"),
    ("stop type", chat(stop=5), 400, "stop"),
    ("empty stop", chat(stop=[""]), 400, "stop"),
    (
        "stream_options without stream",
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    ("tool_choice without tools", chat(tool_choice="required"), 400, "tool_choice"),
    (
        "unknown named tool",
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice.function.name",
    ),
    ("bad tool_choice", chat(tools=TOOLS, tool_choice="sometimes"), 400, "tool_choice"),
    ("bad response_format", chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    (
        "schema missing",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema.schema",
    ),
    ("two constraints", chat(guided_regex="a+", guided_choice=["a"]), 400, "guided_choice"),
    ("guided_json not json", chat(guided_json="{nope"), 400, "guided_json"),
    ("deprecated functions", chat(functions=[{"name": "f"}]), 400, "functions"),
    ("audio", chat(audio={"voice": "x"}), 400, "audio"),
    ("beam search", chat(use_beam_search=True), 400, "use_beam_search"),
    (
        "tool args not json",
        chat(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{x"},
                        }
                    ],
                }
            ]
        ),
        400,
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        "template kwargs clash",
        chat(chat_template_kwargs={"messages": []}),
        400,
        "chat_template_kwargs",
    ),
    (
        "both continue and generation",
        chat(messages=[{"role": "assistant", "content": "a"}], continue_final_message=True),
        200,
        None,
    ),
    (
        "image without media support",
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        ),
        400,
        "messages",
    ),
    (
        "prompt too long",
        chat(messages=[{"role": "user", "content": "word " * 400}]),
        400,
        "messages",
    ),
    ("max_tokens beyond context", chat(max_tokens=250), 400, "max_tokens"),
    ("streamed prompt_logprobs", chat(prompt_logprobs=0, stream=True), 400, "prompt_logprobs"),
    ("min_tokens above max", chat(max_tokens=3, min_tokens=5), 400, "min_tokens"),
    ("unknown model", chat(model="nope"), 404, "model"),
    ("bad rank header", chat(), 400, "x-data-parallel-rank"),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "param"), CHAT_CASES, ids=[c[0] for c in CHAT_CASES]
)
def test_chat_mistakes(
    scripted: ScriptedEngine,
    scripted_http: httpx.Client,
    name: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    headers = {"x-data-parallel-rank": "one"} if name == "bad rank header" else {}
    response = scripted_http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == status, response.text
    if status == 200:
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    if param is not None and status == 400:
        assert param.split(".")[0].split("[")[0] in error["message"]


COMPLETION_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("missing prompt", {"model": SCRIPTED_MODEL}, "prompt"),
    ("empty prompt list", completion(prompt=[]), "prompt"),
    ("mixed batch", completion(prompt=["a", 1]), "prompt[1]"),
    ("negative token", completion(prompt=[1, -2]), "prompt[1]"),
    ("token out of vocab", completion(prompt=[10_000_000]), "prompt"),
    ("nested empty", completion(prompt=[[1], []]), "prompt[1]"),
    ("bool prompt", completion(prompt=[True]), "prompt[0]"),
    ("prompt type", completion(prompt=5), "prompt"),
    ("logprobs range", completion(logprobs=50), "logprobs"),
    ("suffix", completion(suffix="x"), "suffix"),
    ("best_of", completion(best_of=3), "best_of"),
    ("max_tokens 0 without echo", completion(max_tokens=0), "max_tokens"),
    ("prompt_logprobs -1", completion(prompt_logprobs=-1), "prompt_logprobs"),
    ("prompt_logprobs range", completion(prompt_logprobs=21), "prompt_logprobs"),
    ("streamed prompt_logprobs", completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("prompt too long", completion(prompt=[5] * 300), "prompt"),
    ("batch prompt too long", completion(prompt=[[5], [5] * 300]), "prompt[1]"),
]


@pytest.mark.parametrize(
    ("name", "body", "param"), COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES]
)
def test_completion_mistakes(
    scripted: ScriptedEngine,
    scripted_http: httpx.Client,
    name: str,
    body: dict[str, Any],
    param: str | None,
) -> None:
    response = scripted_http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"not json",
        b"[]",
        b'"a string"',
        b"",
        b'{"model": "scripted", "messages": [{"role": "user", "content": "\xff"}]}',
    ],
)
def test_bad_bodies(scripted_http: httpx.Client, raw: bytes) -> None:
    response = scripted_http.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method(scripted_http: httpx.Client) -> None:
    missing = scripted_http.get("/v1/nothing")
    assert missing.status_code == 404
    assert "error" in missing.json()
    wrong = scripted_http.get("/v1/chat/completions")
    assert wrong.status_code == 405
    assert "error" in wrong.json()


def test_an_answered_error_lets_go_of_the_frames_it_passed() -> None:
    """Mapping an error to its answer is its last use: its traceback, and those of the errors
    it was raised from or during, would hold the request's frames in a cycle."""

    def fail() -> None:
        try:
            raise EngineUnavailable("rank 0 is down")
        except EngineUnavailable as down:
            try:
                raise EngineFailure("rank 1 failed") from down
            except EngineFailure:
                raise EngineOverloaded("no rank left") from None

    with pytest.raises(EngineOverloaded) as caught:
        fail()
    error = caught.value
    failure = error.__context__
    assert failure is not None
    assert failure.__cause__ is not None
    chain = (error, failure, failure.__cause__)
    assert all(each.__traceback__ is not None for each in chain)
    assert as_api_error(error).status == 429
    assert all(each.__traceback__ is None for each in chain)


# Every mapped exception type, as a route would raise it, and the answer the client sees:
# status, error ``type``, ``code``, ``param`` and ``Retry-After``.
TABLE: list[tuple[BaseException, int, str, str | None, str | None, str | None]] = [
    (ApiError(418, "teapot", type="x_error", param="p", code="c"), 418, "x_error", "c", "p", None),
    (msgspec.MsgspecError("odd"), 400, "invalid_request_error", None, None, None),
    (msgspec.DecodeError("bad"), 400, "invalid_request_error", "invalid_json", None, None),
    (
        msgspec.ValidationError("Expected `int`, got `str` - at `$.n`"),
        400,
        "invalid_request_error",
        None,
        "n",
        None,
    ),
    (SidecarError("x"), 500, "server_error", "internal_error", None, None),
    (InvalidRequest("x"), 400, "invalid_request_error", "invalid_request", None, None),
    (InvalidRequest("x", param="n"), 400, "invalid_request_error", "invalid_request", "n", None),
    (NotFound("x"), 404, "not_found_error", "model_not_found", "model", None),
    (FailedPrecondition("x"), 400, "invalid_request_error", "unsupported", None, None),
    (EngineOverloaded("x", 2.5), 429, "rate_limit_error", "engine_overloaded", None, "3"),
    (GatewayOverloaded("x", 0.2), 429, "rate_limit_error", "gateway_overloaded", None, "1"),
    (EngineUnavailable("x", 7), 503, "service_unavailable_error", "engine_unavailable", None, "7"),
    (DiscoveryError("x"), 503, "service_unavailable_error", "engine_unavailable", None, "5"),
    (EngineFailure("x"), 500, "server_error", "engine_failure", None, None),
    (BadEngineResponse("x"), 502, "server_error", "bad_engine_response", None, None),
    (
        MediaError(1, "too big", 413, "audio 0"),
        413,
        "invalid_request_error",
        "invalid_audio",
        "messages",
        None,
    ),
    (MediaError(2, "broken"), 400, "invalid_request_error", "invalid_image", "messages", None),
    (
        MediaError(0, "decoders busy", 503, "image 0"),
        503,
        "service_unavailable_error",
        "decoders_unavailable",
        "messages",
        "1",
    ),
    (
        MediaOverBudget(900, 100),
        400,
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
        None,
    ),
    (StarletteHTTPException(404), 404, "not_found_error", "not_found", None, None),
    (StarletteHTTPException(405), 405, "invalid_request_error", "method_not_allowed", None, None),
    (
        RequestValidationError([{"loc": ("body", "x"), "msg": "bad"}]),
        400,
        "invalid_request_error",
        None,
        "x",
        None,
    ),
]


@pytest.mark.parametrize(
    ("error", "status", "kind", "code", "param", "retry_after"),
    TABLE,
    ids=[f"{type(row[0]).__name__}-{row[1]}-{row[3]}" for row in TABLE],
)
def test_each_mapped_type_answers_as_listed(
    error: BaseException,
    status: int,
    kind: str,
    code: str | None,
    param: str | None,
    retry_after: str | None,
) -> None:
    answer = as_api_error(error)
    body = orjson.loads(answer.body())["error"]
    assert (answer.status, body["type"], body["code"], body["param"]) == (status, kind, code, param)
    assert body["message"]
    assert answer.headers().get("Retry-After") == retry_after


def test_the_table_lists_every_mapped_type() -> None:
    assert set(ANSWERED) <= {type(row[0]) for row in TABLE}


def _exported_errors() -> list[type[BaseException]]:
    exported = (getattr(rankgate.sidecar, name) for name in rankgate.sidecar.__all__)
    return [kind for kind in exported if isinstance(kind, type) and issubclass(kind, Exception)]


def test_every_error_a_route_can_raise_has_its_own_row() -> None:
    """A route raises the sidecar's errors, the media package's, and :class:`ApiError`; each
    answers by a row of its own, not by a base's that happens to be near."""
    sidecar = _exported_errors()
    assert {SidecarError, GatewayOverloaded} <= set(sidecar)
    raised = {*sidecar, MediaError, MediaOverBudget, ApiError}
    assert raised - ANSWERED == set()


class _Busy(InvalidRequest, EngineUnavailable):
    pass


class _Chosen(GatewayOverloaded):
    pass


def test_an_unlisted_type_answers_as_its_nearest_listed_base() -> None:
    # KvLeaseExpired has no row: it is one way for the engine to be unavailable.
    assert as_api_error(KvLeaseExpired("lease ended", 2)).status == 503
    assert as_api_error(_Chosen("x")).code == "gateway_overloaded"
    # Along the MRO, InvalidRequest comes before EngineUnavailable (and before SidecarError).
    assert as_api_error(_Busy("x")).code == "invalid_request"


def test_an_unmapped_error_is_a_logged_500(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, "rankgate.app.errors"):
        answer = as_api_error(RuntimeError("boom"))
    assert (answer.status, answer.code, answer.message) == (
        500,
        "internal_error",
        "Internal server error",
    )
    assert [record.exc_info is not None for record in caplog.records] == [True]


# The kinds of ApiError the routes build, and what each tells the client.
KINDS: list[tuple[ApiError, int, str, str | None, str | None]] = [
    (invalid("bad", "n"), 400, "invalid_request_error", None, "n"),
    (invalid("bad", code="invalid_json"), 400, "invalid_request_error", "invalid_json", None),
    (unsupported("suffix"), 400, "invalid_request_error", "unsupported_parameter", "suffix"),
    (model_not_found("m"), 404, "invalid_request_error", "model_not_found", "model"),
    (
        response_not_found("r", "previous_response_id"),
        404,
        "invalid_request_error",
        "previous_response_not_found",
        "previous_response_id",
    ),
    (
        response_not_found("r", "response_id"),
        404,
        "invalid_request_error",
        "not_found",
        "response_id",
    ),
    (
        response_not_found("r", "response_id", workers=2),
        404,
        "invalid_request_error",
        "response_on_other_worker",
        "response_id",
    ),
    (client_gone("gone"), 499, "invalid_request_error", "client_disconnected", None),
]


@pytest.mark.parametrize(("error", "status", "kind", "code", "param"), KINDS)
def test_each_api_error_kind_answers_as_built(
    error: ApiError, status: int, kind: str, code: str | None, param: str | None
) -> None:
    answer = as_api_error(error)
    assert answer is error
    body = orjson.loads(answer.body())["error"]
    assert (answer.status, body["type"], body["code"], body["param"]) == (status, kind, code, param)
