"""Fields Rankgate does not know, through HTTP: ignored and logged once, as vLLM's server does;
a 400 naming them with ``--reject-unknown-fields``. Known fields keep their checks either way."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.limits import InputLimits
from rankgate.app.schemas import unknown_fields
from rankgate.app.schemas.requests import ChatCompletionRequest
from rankgate.app.schemas.unknown_fields import MAX_IGNORED
from rankgate.app.server import create_app
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)


@pytest.fixture(scope="module")
def lenient(engine: ScriptedEngine) -> Iterator[httpx.Client]:
    with (
        serve_app(create_app(GatewaySettings(), engine=engine)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def strict(engine: ScriptedEngine) -> Iterator[httpx.Client]:
    settings = GatewaySettings(limits=InputLimits(reject_unknown_fields=True))
    with (
        serve_app(create_app(settings, engine=engine)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        yield client


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SCRIPTED_MODEL, "messages": USER, "max_tokens": 4, **fields}


def warnings_about(caplog: pytest.LogCaptureFixture, field: str) -> int:
    return sum(
        1
        for record in caplog.records
        if record.name == "rankgate.requests" and repr(field) in record.getMessage()
    )


def test_the_sdks_newer_fields_are_ignored_and_logged_once(
    lenient: httpx.Client, engine: ScriptedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "rankgate.requests")
    field = "prompt_cache_retention_t1"
    for _ in range(2):
        body = chat(temperature=0.25, **{field: "24h"})
        response = lenient.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        # The known fields beside it still reach the engine.
        assert engine.requests[-1].sampling.temperature == 0.25
    assert warnings_about(caplog, field) == 1


def test_unknown_fields_at_any_depth_are_dropped(
    lenient: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "rankgate.requests")
    messages = [
        {"role": "system", "content": "be brief", "cache_hint_t2": 1},
        {"role": "user", "content": [{"type": "text", "text": "hi", "weight_t2": 2}]},
    ]
    body = chat(messages=messages, stream_options_extra_t2=True)
    response = lenient.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    for field in (
        "messages.cache_hint_t2",
        "messages.content.weight_t2",
        "stream_options_extra_t2",
    ):
        assert warnings_about(caplog, field) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": SCRIPTED_MODEL, "prompt": "hi", "max_tokens": 2, "x_t3": 1}),
        ("/v1/responses", {"model": SCRIPTED_MODEL, "input": "hi", "x_t3": 1}),
        (
            "/v1/responses",
            {"model": SCRIPTED_MODEL, "input": [{"role": "user", "content": "hi", "x_t3": 1}]},
        ),
        ("/tokenize", {"model": SCRIPTED_MODEL, "prompt": "hi", "x_t3": 1}),
    ],
    ids=["completions", "responses", "responses input item", "tokenize"],
)
def test_every_endpoint_ignores_them(lenient: httpx.Client, path: str, body: Any) -> None:
    assert lenient.post(path, json=body).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(use_beam_search=True, x_t4=1), "use_beam_search"),  # known, refused
        (chat(temperature="hot", x_t4=1), "temperature"),  # known, wrong type
        (chat(messages=[{"role": "wizard", "content": "x", "x_t4": 1}]), "messages[0].role"),
    ],
    ids=["refused field", "bad value", "bad role"],
)
def test_known_fields_keep_their_errors(lenient: httpx.Client, body: Any, param: str) -> None:
    response = lenient.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_body_of_many_unknown_fields_is_read_in_one_pass(lenient: httpx.Client) -> None:
    body = chat(**{f"x{i}_t5": i for i in range(4 * MAX_IGNORED)})
    assert lenient.post("/v1/chat/completions", json=body).status_code == 200


def test_nested_unknown_fields_past_the_bound_are_refused(lenient: httpx.Client) -> None:
    def with_unknowns(count: int) -> dict[str, Any]:
        messages = [{"role": "user", "content": "hi", f"x{i}_t6": i} for i in range(count)]
        return chat(messages=messages)

    response = lenient.post("/v1/chat/completions", json=with_unknowns(MAX_IGNORED + 1))
    assert response.status_code == 400
    assert "Unrecognized request argument" in response.json()["error"]["message"]
    # As many as the bound are read (the 64 messages would not fit the tiny model's context).
    body = msgspec.json.encode(with_unknowns(MAX_IGNORED))
    decoder = msgspec.json.Decoder(ChatCompletionRequest)
    with pytest.raises(msgspec.ValidationError) as strict:
        decoder.decode(body)
    read = unknown_fields.decode_ignoring_unknown(body, decoder, strict.value)
    assert len(read.messages) == MAX_IGNORED


def test_a_large_body_is_decoded_again_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each nested unknown field costs a decode of the whole body; a body past the budget
    gets one retry, however many fields it has, and then the strict error stands."""
    monkeypatch.setattr(unknown_fields, "REDECODE_BUDGET", 1)
    decoder = msgspec.json.Decoder(ChatCompletionRequest)

    def decode(count: int) -> ChatCompletionRequest:
        messages = [{"role": "user", "content": "hi", f"x{i}_t7": i} for i in range(count)]
        body = msgspec.json.encode(chat(messages=messages))
        try:
            return decoder.decode(body)
        except msgspec.ValidationError as first:
            return unknown_fields.decode_ignoring_unknown(body, decoder, first)

    assert len(decode(1).messages) == 1
    with pytest.raises(msgspec.ValidationError, match="unknown field `x1_t7`"):
        decode(2)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(temprature=0.5), "temprature"),
        (chat(messages=[{"role": "user", "content": "x", "foo": 1}]), "messages[0].foo"),
        (
            {"model": SCRIPTED_MODEL, "input": [{"role": "user", "content": "x", "foo": 1}]},
            "input[0].foo",
        ),
    ],
    ids=["top level", "in a message", "in a responses input item"],
)
def test_strict_mode_refuses_them_like_openai(strict: httpx.Client, body: Any, param: str) -> None:
    path = "/v1/responses" if "input" in body else "/v1/chat/completions"
    response = strict.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] == f"Unrecognized request argument supplied: {param}"


def test_fields_vllm_removed_are_applied_with_vllms_warning(
    lenient: httpx.Client,
    engine: ScriptedEngine,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's server ignores its removed guided_* fields and warns; Rankgate still constrains
    the output (a client written for an older vLLM keeps working) and warns once per name."""
    from rankgate.app.prepare import params

    monkeypatch.setattr(params, "_warned_removed", set())
    caplog.set_level(logging.WARNING, "rankgate.app.prepare.params")
    for _ in range(2):
        body = chat(guided_regex="[ab]+", guided_decoding_backend="xgrammar")
        response = lenient.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        structured = engine.requests[-1].structured
        assert structured is not None
        assert (structured.kind, structured.spec) == ("regex", "[ab]+")
    warnings = [r.getMessage() for r in caplog.records if "vLLM has removed" in r.getMessage()]
    assert len(warnings) == 1
    assert "guided_regex" in warnings[0]
    assert "guided_decoding_backend" in warnings[0]
    assert "structured_outputs" in warnings[0]


def test_the_openapi_document_says_which_policy_serves(
    lenient: httpx.Client, strict: httpx.Client
) -> None:
    """Request objects are open by default (extras are ignored) and closed in strict mode."""

    def closed(client: httpx.Client) -> set[str]:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        return {name for name, s in schemas.items() if s.get("additionalProperties") is False}

    assert closed(lenient) == set()
    assert {"ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"} <= closed(strict)
