"""The OpenAI SDK through the gateway against real vLLM, with the tiny model's chat template.

Run with ``scripts/in-netns .venv/bin/pytest tests/app/test_real_vllm.py -m real_vllm``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.prepare.template import ChatTemplate
from rankgate.app.server import create_app
from rankgate.app.tokens.tokenizer import TextTokenizer
from tests.app.serving import serve_app
from tests.support.engines import EngineUnderTest

pytestmark = pytest.mark.real_vllm

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something about the sea."},
]


@pytest.fixture(scope="module")
def real_gateway(real_vllm: EngineUnderTest) -> Iterator[tuple[Any, EngineUnderTest]]:
    settings = GatewaySettings(engine=real_vllm.target, tokenizer=str(real_vllm.tokenizer_dir))
    with (
        serve_app(create_app(settings), timeout=300) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield client, real_vllm


def _prompt_tokens(engine: EngineUnderTest) -> int:
    tok = TextTokenizer(engine.tokenizer_dir)
    assert tok.files.chat_template is not None
    template = ChatTemplate(tok.files.chat_template, tok.files.special_tokens)
    messages: list[dict[str, Any]] = [dict(m) for m in MESSAGES]
    if template.content_format == "openai":
        messages = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in messages]
    return len(tok.encode(template.render(messages), False))


def test_chat_streaming_and_not(real_gateway: tuple[Any, EngineUnderTest]) -> None:
    client, engine = real_gateway
    kwargs = {
        "model": engine.served_model_name,
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == _prompt_tokens(engine)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_batch_and_n(real_gateway: tuple[Any, EngineUnderTest]) -> None:
    client, engine = real_gateway
    result = client.completions.create(
        model=engine.served_model_name,
        prompt=["The sea is", "Waves"],
        n=2,
        max_tokens=4,
        temperature=0.0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.choices[0].text == result.choices[1].text
    for choice in result.choices:
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == 4
    assert result.usage.completion_tokens == 16
    stream = client.completions.create(
        model=engine.served_model_name,
        prompt="The sea is",
        max_tokens=4,
        temperature=0.0,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == result.choices[0].text


def test_engine_validation_errors_are_400(real_gateway: tuple[Any, EngineUnderTest]) -> None:
    client, engine = real_gateway
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=engine.served_model_name, prompt="x", max_tokens=10_000)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == "max_tokens"


def test_responses_streaming_and_not(real_gateway: tuple[Any, EngineUnderTest]) -> None:
    client, engine = real_gateway
    kwargs: dict[str, Any] = {
        "model": engine.served_model_name,
        "instructions": MESSAGES[0]["content"],
        "input": MESSAGES[1]["content"],
        "max_output_tokens": 12,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12
    # The same conversation as the chat test: vLLM counts the same prompt.
    assert whole.usage.input_tokens == _prompt_tokens(engine)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.usage.model_dump() == whole.usage.model_dump()
    # /tokenize counts what vLLM counted.
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    counted = httpx.post(f"{root}/tokenize", json={"messages": MESSAGES}, timeout=60).json()
    assert counted["count"] == whole.usage.input_tokens
