"""Response shapes through HTTP with a scripted engine: parsers, logprobs, LoRA, failures."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from rankgate.sidecar.errors import (
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
    KvLeaseExpired,
    SidecarError,
)
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine
from tests.support.polling import wait_until

USER = [{"role": "user", "content": "What's the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_OUTPUT = (
    "<think>The user wants weather.</think>Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _sse(response: httpx.Response) -> list[Any]:
    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: ")
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_reasoning_and_tool_calls(scripted: ScriptedEngine, scripted_client: Any) -> None:
    scripted.outputs = [TOOL_OUTPUT]
    result = scripted_client.chat.completions.create(
        model=SCRIPTED_MODEL,
        messages=USER,
        tools=TOOLS,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    assert choice.message.reasoning_content == "The user wants weather."
    calls = choice.message.tool_calls
    assert calls is not None
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    sent = scripted.requests[-1]
    assert sent.output.skip_special_tokens is False


def test_streamed_tool_calls_match(scripted: ScriptedEngine, scripted_client: Any) -> None:
    scripted.outputs = [TOOL_OUTPUT]
    chunks = list(
        scripted_client.chat.completions.create(
            model=SCRIPTED_MODEL,
            messages=USER,
            tools=TOOLS,
            stream=True,
        )
    )
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert reasoning == "The user wants weather."
    assert content == "Let me check.\n"
    # OpenAI's shape: the call's id and name first, then its arguments.
    assert [c.index for c in calls] == [0, 0]
    assert calls[0].id is not None
    assert calls[0].function is not None
    assert calls[0].function.name == "get_weather"
    assert calls[1].id is None
    assert calls[1].function is not None
    assert json.loads(calls[1].function.arguments or "") == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_text_stays_content(
    scripted: ScriptedEngine, scripted_client: Any
) -> None:
    scripted.outputs = ['<tool_call>{"name": "x", "arguments": {}}</tool_call>']
    result = scripted_client.chat.completions.create(model=SCRIPTED_MODEL, messages=USER)
    assert result.choices[0].message.content == scripted.outputs[0]
    assert not result.choices[0].message.tool_calls
    assert result.choices[0].finish_reason == "stop"


def test_named_tool_choice_forces_a_call(scripted: ScriptedEngine, scripted_client: Any) -> None:
    # The scripted model thinks first (qwen3 reasoning), then calls in hermes format, as the
    # structural tag of vLLM's strict tool calling holds it to.
    scripted.outputs = [
        '<think>Oslo.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        "</tool_call>"
    ]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    result = scripted_client.chat.completions.create(
        model=SCRIPTED_MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice=choice,
    )
    calls = result.choices[0].message.tool_calls
    assert calls is not None
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    assert result.choices[0].finish_reason == "stop"
    structured = scripted.requests[-1].structured
    assert structured is not None
    assert structured.kind == "structural_tag"
    tag = json.loads(structured.spec)["format"]
    assert tag["stop_after_first"] is True
    assert {t["begin"].split('"name": ')[1] for t in tag["tags"]} == {
        '"get_weather", "arguments": '
    }


def test_required_tool_choice(scripted: ScriptedEngine, scripted_client: Any) -> None:
    scripted.outputs = [
        '<think>Rome.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
        "</tool_call>"
    ]
    result = scripted_client.chat.completions.create(
        model=SCRIPTED_MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
    )
    calls = result.choices[0].message.tool_calls
    assert calls is not None
    assert json.loads(calls[0].function.arguments) == {"city": "Rome"}
    assert result.choices[0].finish_reason == "tool_calls"


def test_chat_logprobs_format(scripted: ScriptedEngine, scripted_client: Any) -> None:
    scripted.outputs = ["héllo"]
    result = scripted_client.chat.completions.create(
        model=SCRIPTED_MODEL,
        messages=USER,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    assert bytes(b for entry in logprobs.content for b in entry.bytes or []) == "héllo".encode()
    for entry in logprobs.content:
        assert entry.logprob == -0.25
        assert [t.logprob for t in entry.top_logprobs] == [-0.5, -1.0]
    assert scripted.requests[-1].output.logprobs == 2


def test_response_format_and_sampling_mapping(
    scripted: ScriptedEngine, scripted_http: httpx.Client
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response = scripted_http.post(
        "/v1/chat/completions",
        json={
            "model": "scripted-alias",
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
            "top_k": -1,
            "stop": "END",
            "logit_bias": {"7": 5},
            "max_completion_tokens": 9,
            "cache_salt": "s1",
            "priority": 3,
        },
        headers={"x-data-parallel-rank": "1"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "scripted-alias"
    sent = scripted.requests[-1]
    assert sent.structured is not None
    assert json.loads(sent.structured.spec) == schema
    assert sent.sampling.temperature == 1.0
    assert sent.sampling.top_k == 0
    assert sent.sampling.logit_bias == {7: 5.0}
    assert sent.stopping.stop == ("END",)
    assert sent.stopping.max_tokens == 9
    assert (sent.cache_salt, sent.priority, sent.rank, sent.lora_name) == ("s1", 3, 1, None)


def test_lora_models(scripted: ScriptedEngine, scripted_client: Any) -> None:
    scripted.loras = ("my-lora", "fresh-lora")
    models = {m.id: m for m in scripted_client.models.list().data}
    assert next(iter(models)) == SCRIPTED_MODEL
    assert models["fresh-lora"].parent == SCRIPTED_MODEL
    assert models["scripted-alias"].parent is None
    scripted_client.chat.completions.create(model="fresh-lora", messages=USER)
    assert scripted.requests[-1].lora_name == "fresh-lora"


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (EngineOverloaded("busy", retry_after=2.5), 429, "3"),
        (EngineUnavailable("down", retry_after=1.0), 503, "1"),
        (KvLeaseExpired("the prefill's KV lease could end", retry_after=1.0), 503, "1"),
        (InvalidRequest("bad prompt"), 400, None),
        (EngineFailure("boom"), 500, None),
    ],
)
def test_engine_errors_before_output(
    scripted: ScriptedEngine,
    scripted_http: httpx.Client,
    error: SidecarError,
    status: int,
    retry_after: str | None,
) -> None:
    scripted.fail_after = (0, error)
    for stream in (False, True):
        response = scripted_http.post(
            "/v1/chat/completions",
            json={"model": SCRIPTED_MODEL, "messages": USER, "stream": stream},
        )
        assert response.status_code == status
        assert response.headers.get("retry-after") == retry_after
        body = response.json()["error"]
        assert body["message"] == str(error)
        assert set(body) == {"message", "type", "param", "code"}


def test_error_after_stream_began(scripted: ScriptedEngine, scripted_http: httpx.Client) -> None:
    scripted.outputs = ["one two three four five"]
    scripted.fail_after = (3, EngineFailure("engine died mid-stream"))
    with scripted_http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": SCRIPTED_MODEL, "messages": USER, "stream": True},
    ) as response:
        assert response.status_code == 200
        events = _sse(response)
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict)
    assert error["error"]["message"] == "engine died mid-stream"
    assert all(isinstance(e, dict) and "choices" in e for e in events[:-2])


def test_sdk_raises_on_mid_stream_error(scripted: ScriptedEngine, scripted_client: Any) -> None:
    scripted.outputs = ["one two three four five"]
    scripted.fail_after = (2, EngineFailure("engine died mid-stream"))
    stream = scripted_client.chat.completions.create(
        model=SCRIPTED_MODEL,
        messages=USER,
        stream=True,
    )
    with pytest.raises(openai.APIError, match="engine died mid-stream"):
        list(stream)


def test_client_disconnect_drops_the_engine_stream(
    scripted: ScriptedEngine, scripted_gateway: str
) -> None:
    scripted.outputs = ["word " * 150]
    scripted.delay = 0.01
    before, cut = scripted.closed, scripted.cut
    with (
        httpx.Client(base_url=scripted_gateway) as client,
        client.stream(
            "POST",
            "/v1/completions",
            json={"model": SCRIPTED_MODEL, "prompt": "x", "stream": True, "max_tokens": 200},
        ) as response,
    ):
        assert response.status_code == 200
        next(response.iter_lines())

    wait_until(lambda: scripted.closed > before, 5, "the engine stream closed")
    assert scripted.closed == before + 1
    assert scripted.cut == cut + 1, "the engine stream ran to its end"


def test_non_streaming_client_disconnect_drops_the_engine_stream(
    scripted: ScriptedEngine, scripted_gateway: str
) -> None:
    scripted.outputs = ["word " * 300]
    scripted.delay = 0.01
    before, cut = scripted.closed, scripted.cut
    with (
        httpx.Client(base_url=scripted_gateway, timeout=0.3) as client,
        pytest.raises(httpx.ReadTimeout),
    ):
        client.post("/v1/completions", json={"model": SCRIPTED_MODEL, "prompt": "x"})
    wait_until(lambda: scripted.closed > before, 10, "the engine stream closed")
    assert scripted.closed == before + 1
    # Before its 300th token: the gateway dropped it.
    assert scripted.cut == cut + 1, "the engine stream ran to its end"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_nested_past_any_depth_is_text_not_an_error(
    scripted: ScriptedEngine, scripted_http: httpx.Client, stream: bool
) -> None:
    """The model's JSON, however deep, ends as a call that does not parse ends: the text
    comes back as content, with 200, never a 500."""
    deep = '{"name": "get_weather", "arguments": ' + "[" * 3000
    scripted.outputs = [f"<think>ok</think><tool_call>\n{deep}\n</tool_call>"]
    body = {"model": SCRIPTED_MODEL, "messages": USER, "tools": TOOLS, "stream": stream}
    response = scripted_http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text[:300]
    if stream:
        chunks = [c for c in _sse(response) if c != "[DONE]"]
        assert not any("error" in c for c in chunks)
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        calls = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    else:
        message = response.json()["choices"][0]["message"]
        text, calls = message["content"] or "", message.get("tool_calls") or []
    assert not calls
    assert "[[[[" in text
