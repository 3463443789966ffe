"""``client.responses`` of the official OpenAI SDK against the gateway and the mock engine.

Every request runs the real sidecar against the mock vLLM, so prompts, images, structured
outputs and token counts are checked against what the engine itself saw and reported.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.app.test_openai_sdk import MODEL, _prompt_len
from tests.multimodal.pictures import data_uri, encode, noise
from tests.multimodal.test_gateway_images import mock_tokens

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_create_non_streaming(mock_client: Any) -> None:
    result = mock_client.responses.create(
        model=MODEL,
        instructions="You are terse.",
        input="Name three colours.",
        max_output_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "response"
    assert result.id.startswith("resp_")
    assert result.model == MODEL
    assert result.status == "incomplete"
    assert result.incomplete_details is not None
    assert result.incomplete_details.reason == "max_output_tokens"
    [message] = result.output
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.status == "incomplete"
    assert result.output_text == message.content[0].text
    assert result.output_text
    assert result.usage is not None
    assert result.usage.output_tokens == 6
    # The same conversation as a chat: instructions are the system message.
    expected = _prompt_len(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."},
        ]
    )
    assert result.usage.input_tokens == expected
    assert result.usage.total_tokens == expected + 6


def test_streaming_matches_non_streaming(mock_client: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "input": [{"role": "user", "content": "Count to ten."}],
        "max_output_tokens": 12,
        "temperature": 0.8,
        "extra_body": {"ignore_eos": True, "seed": 11},
    }
    whole = mock_client.responses.create(**kwargs)
    events = list(mock_client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.status == "incomplete"
    assert final.output_text == text
    assert final.usage.model_dump() == whole.usage.model_dump()
    # The SDK's own accumulator agrees with the events.
    with mock_client.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == text


def test_an_image_reaches_the_engine(mock_client: Any) -> None:
    picture = noise(90, 60, seed=5)
    content = [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": data_uri(encode(picture, "PNG")), "detail": "auto"},
    ]
    text_only = mock_client.responses.create(
        model=MODEL, input=[{"role": "user", "content": content[:1]}], max_output_tokens=1
    )
    result = mock_client.responses.create(
        model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=1
    )
    assert result.status in ("completed", "incomplete")
    # One placeholder, expanded by the engine into the picture's patches.
    assert result.usage.input_tokens == text_only.usage.input_tokens + mock_tokens(90, 60)


def test_function_tool_round_trip(mock_client: Any) -> None:
    question = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = mock_client.responses.create(
        model=MODEL,
        input=question,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert call.call_id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"}
    assert arguments["unit"] in ("c", "f")

    answer = mock_client.responses.create(
        model=MODEL,
        input=[
            *question,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
        ],
        tools=[WEATHER],
        max_output_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert answer.output[0].type == "message"
    assert answer.output_text
    # The call and its output were rendered into the prompt: it grew past the first one.
    assert answer.usage.input_tokens > first.usage.input_tokens

    # The same round trip streamed: the call's arguments arrive as deltas.
    events = list(
        mock_client.responses.create(
            model=MODEL,
            input=question,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    streamed = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert done.arguments == streamed
    assert json.loads(streamed).keys() == {"city", "unit"}
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].type == "function_call"


def test_a_call_output_for_an_unknown_call_is_refused(mock_client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        mock_client.responses.create(
            model=MODEL,
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
        )
    body: Any = caught.value.body
    assert body["param"] == "input[0].call_id"


def test_previous_response_id_continues_the_conversation(mock_client: Any) -> None:
    first = mock_client.responses.create(
        model=MODEL,
        instructions="You are terse.",
        input="Pick a colour.",
        max_output_tokens=4,
        extra_body={"ignore_eos": True},
    )
    follow = mock_client.responses.create(
        model=MODEL,
        input="Why that one?",
        previous_response_id=first.id,
        max_output_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert follow.previous_response_id == first.id
    # Instructions do not carry over; the earlier turn and its answer do.
    expected = _prompt_len(
        [
            {"role": "user", "content": "Pick a colour."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Why that one?"},
        ]
    )
    assert follow.usage.input_tokens == expected

    fetched = mock_client.responses.retrieve(follow.id)
    assert fetched.output_text == follow.output_text
    assert fetched.usage == follow.usage
    mock_client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        mock_client.responses.retrieve(follow.id)
    with pytest.raises(openai.NotFoundError) as caught:
        mock_client.responses.create(model=MODEL, input="And then?", previous_response_id=follow.id)
    body: Any = caught.value.body
    assert body["code"] == "previous_response_not_found"


def test_json_schema_format_constrains_the_output(mock_client: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    result = mock_client.responses.create(
        model=MODEL,
        input="Describe a flag.",
        text={"format": {"type": "json_schema", "name": "flag", "schema": schema}},
    )
    value = json.loads(result.output_text)
    assert set(value) == {"colour", "count"}
    assert isinstance(value["count"], int)
    assert result.text.format.type == "json_schema"
