"""/v1/responses through HTTP with a scripted engine: items, events, refusals, the store."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.auth import AccessConfig
from rankgate.app.prepare.template import ChatTemplate
from rankgate.app.server import create_app
from rankgate.app.tokens.tokenizer import TextTokenizer
from rankgate.sidecar.errors import EngineFailure
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER

REASONED_CALL = (
    "<think>The user wants weather.</think>Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def post(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": SCRIPTED_MODEL, **body})


def events_of(response: httpx.Response) -> list[dict[str, Any]]:
    """The stream's events; each ``event:`` line must name its data's type."""
    out: list[dict[str, Any]] = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        out.append(event)
    return out


def test_reasoning_text_and_calls_become_items(scripted: ScriptedEngine, scripted_http) -> None:
    scripted.outputs = [REASONED_CALL]
    body = post(scripted_http, input="Weather in Paris?", tools=[TOOL]).json()
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    reasoning, message, call = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
    assert reasoning["id"].startswith("rs_")
    assert message["content"][0]["text"].strip() == "Let me check."
    assert message["id"].startswith("msg_")
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("chatcmpl-tool-")  # vLLM's tool-call id
    assert call["id"].startswith("fc_")
    assert call["status"] == "completed"
    assert body["status"] == "completed"
    usage = body["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]
    assert body["tools"] == [TOOL]


def test_streamed_events_tell_the_same_items(scripted: ScriptedEngine, scripted_http) -> None:
    scripted.outputs = [REASONED_CALL]
    whole = post(scripted_http, input="Weather in Paris?", tools=[TOOL]).json()
    response = post(scripted_http, input="Weather in Paris?", tools=[TOOL], stream=True)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    squeezed: list[str] = []
    for e in events:
        if not squeezed or squeezed[-1] != e["type"]:
            squeezed.append(e["type"])
    assert squeezed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    final = events[-1]["response"]
    for streamed, built in zip(final["output"], whole["output"], strict=True):
        assert {k: v for k, v in streamed.items() if k not in ("id", "call_id")} == {
            k: v for k, v in built.items() if k not in ("id", "call_id")
        }
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "The user wants weather."
    assert final["usage"] == whole["usage"]


def test_a_failure_mid_stream_is_response_failed(scripted: ScriptedEngine, scripted_http) -> None:
    scripted.outputs = ["one two three four five six"]
    scripted.fail_after = (3, EngineFailure("engine died mid-stream"))
    events = events_of(post(scripted_http, input="hi", stream=True))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "engine died mid-stream"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "engine_failure"
    assert failed["output"][0]["status"] == "incomplete"
    assert scripted.closed >= 1
    # Not stored: a failed response has nothing to continue from.
    found = scripted_http.get(f"/v1/responses/{failed['id']}")
    assert found.status_code == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            "tool_choice.type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
        ),
        ({"input": []}, "input"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
        # str.isdigit accepts a superscript two that int() refuses.
        ({"logit_bias": {"\xb2": 1.0}}, "logit_bias"),
    ],
)
def test_unsupported_and_invalid_fields_are_400_naming_them(
    scripted_http, body: dict[str, Any], param: str
) -> None:
    response = post(scripted_http, **{"input": "hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_chat_errors_name_the_responses_fields(scripted_http) -> None:
    too_long = "word " * 400
    error = post(scripted_http, input=[{"role": "user", "content": too_long}]).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "input"
    assert "messages" not in error["message"]
    error = post(scripted_http, input="hi", max_output_tokens=255).json()["error"]
    assert error["param"] == "max_output_tokens"
    assert "'max_output_tokens' is too large" in error["message"]


def test_follow_up_renders_the_stored_turns(scripted: ScriptedEngine, scripted_http) -> None:
    scripted.outputs = [REASONED_CALL]
    first = post(scripted_http, instructions="Be brief.", input="Weather?", tools=[TOOL]).json()
    call = first["output"][-1]
    scripted.outputs = ["It is sunny."]
    follow = post(
        scripted_http,
        previous_response_id=first["id"],
        input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
        tools=[TOOL],
    )
    assert follow.status_code == 200, follow.text
    assert follow.json()["output"][0]["content"][0]["text"] == "It is sunny."
    tok = TextTokenizer(TINY_TOKENIZER)
    assert tok.files.chat_template is not None
    template = ChatTemplate(tok.files.chat_template, tok.files.special_tokens)
    rendered = template.render(
        [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": first["output"][1]["content"][0]["text"]}],
                "reasoning_content": "The user wants weather.",
                "tool_calls": [
                    {
                        "id": call["call_id"],
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {
                "role": "tool",
                "content": [{"type": "text", "text": "sunny"}],
                "tool_call_id": call["call_id"],
            },
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": TOOL["parameters"]},
            }
        ],
    )
    assert scripted.requests[-1].prompt_token_ids == tuple(tok.encode(rendered, False))


def test_store_false_keeps_nothing(scripted_http) -> None:
    body = post(scripted_http, input="hi", store=False).json()
    assert body["store"] is False
    assert scripted_http.get(f"/v1/responses/{body['id']}").status_code == 404
    follow = post(scripted_http, input="more", previous_response_id=body["id"])
    assert follow.status_code == 404
    assert follow.json()["error"]["param"] == "previous_response_id"


def test_delete_answers_as_openai_does(scripted_client: openai.OpenAI, scripted_http) -> None:
    made = scripted_client.responses.create(model=SCRIPTED_MODEL, input="hi")
    deleted = scripted_http.delete(f"/v1/responses/{made.id}")
    assert deleted.json() == {"id": made.id, "object": "response.deleted", "deleted": True}
    again = scripted_http.delete(f"/v1/responses/{made.id}")
    assert again.status_code == 404
    assert again.json()["error"]["code"] == "not_found"


def test_another_workers_response_is_refused_by_name(scripted: ScriptedEngine) -> None:
    settings = GatewaySettings(workers=2)
    with (
        serve_app(create_app(settings, engine=scripted)) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        mine = post(http, input="hi").json()["id"]
        assert post(http, input="more", previous_response_id=mine).status_code == 200
        other = "resp_" + ("0" if mine[5] != "0" else "1") + mine[6:]
        refused = post(http, input="more", previous_response_id=other)
        assert refused.status_code == 404
        error = refused.json()["error"]
        assert error["code"] == "response_on_other_worker"
        assert "2 workers" in error["message"]


def test_openapi_documents_the_endpoints(scripted_http) -> None:
    document = scripted_http.get("/openapi.json").json()
    paths = document["paths"]
    assert "post" in paths["/v1/responses"]
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    schemas = document["components"]["schemas"]
    for name in ("ResponsesRequest", "ResponseObject", "MessageItem", "FunctionCallOutputItem"):
        assert name in schemas
    assert "max_output_tokens" in schemas["ResponsesRequest"]["properties"]


TENANT_KEYS = ("sk-tenant-a-5e1c", "sk-tenant-b-93f0")


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _error_without_id(response: httpx.Response, response_id: str) -> dict[str, Any]:
    error = response.json()["error"]
    return {**error, "message": error["message"].replace(response_id, "<id>")}


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_response_belongs_to_its_key(scripted: ScriptedEngine, stream: bool) -> None:
    """Every verb on a stored response answers another key exactly as it answers an id that
    was never issued, so neither the content nor the id's existence crosses tenants."""
    settings = GatewaySettings(access=AccessConfig(api_keys=TENANT_KEYS))
    owner, other = (_as(key) for key in TENANT_KEYS)
    with (
        serve_app(create_app(settings, engine=scripted)) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        body = {"model": SCRIPTED_MODEL, "input": "secret", "stream": stream}
        made = http.post("/v1/responses", json=body, headers=owner)
        assert made.status_code == 200, made.text
        rid = events_of(made)[-1]["response"]["id"] if stream else made.json()["id"]
        unknown = "resp_" + "f" * (len(rid) - 5)

        def follow_up(response_id: str, headers: dict[str, str]) -> httpx.Response:
            return post_as(http, headers, input="more", previous_response_id=response_id)

        verbs = {
            "get": lambda i, h: http.get(f"/v1/responses/{i}", headers=h),
            "delete": lambda i, h: http.delete(f"/v1/responses/{i}", headers=h),
            "previous_response_id": follow_up,
        }
        for verb, call in verbs.items():
            refused, never_issued = call(rid, other), call(unknown, other)
            assert refused.status_code == never_issued.status_code == 404, verb
            assert _error_without_id(refused, rid) == _error_without_id(never_issued, unknown)
        # The refusals changed nothing: the owner still reads, continues and deletes it.
        got = http.get(f"/v1/responses/{rid}", headers=owner)
        assert got.status_code == 200
        assert got.json()["id"] == rid
        assert follow_up(rid, owner).status_code == 200
        assert http.delete(f"/v1/responses/{rid}", headers=owner).status_code == 200
        assert http.get(f"/v1/responses/{rid}", headers=owner).status_code == 404


def post_as(http: httpx.Client, headers: dict[str, str], **body: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": SCRIPTED_MODEL, **body}, headers=headers)
