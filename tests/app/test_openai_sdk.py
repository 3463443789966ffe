"""The official OpenAI SDK against the gateway, backed by the mock engine through the sidecar."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from rankgate.app.prepare.template import ChatTemplate
from rankgate.app.tokens.tokenizer import TextTokenizer
from tests.conftest import TINY_TOKENIZER

MODEL = "tiny-llama"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def _prompt_len(messages: list[dict[str, str]]) -> int:
    tok = TextTokenizer(TINY_TOKENIZER)
    assert tok.files.chat_template is not None
    template = ChatTemplate(tok.files.chat_template, tok.files.special_tokens)
    rendered = template.render(
        [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in messages]
    )
    return len(tok.encode(rendered, False))


def test_chat_non_streaming(mock_client: Any) -> None:
    result = mock_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    assert result.model == MODEL
    choice = result.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert result.usage is not None
    assert result.usage.completion_tokens == 6
    assert result.usage.prompt_tokens == _prompt_len(MESSAGES)
    assert result.usage.total_tokens == result.usage.prompt_tokens + 6


def test_chat_streaming_matches_non_streaming(mock_client: Any) -> None:
    kwargs = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 12,
        "seed": 7,
        "temperature": 0.8,
        "extra_body": {"ignore_eos": True},
    }
    whole = mock_client.chat.completions.create(**kwargs)
    stream = mock_client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1
    assert usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert whole.usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert {c.id for c in chunks} == {chunks[0].id}


def test_chat_n_choices_interleaved_in_stream(mock_client: Any) -> None:
    stream = mock_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        n=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2]
    assert finished == {0: "length", 1: "length", 2: "length"}
    whole = mock_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        n=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 15


def test_stop_string_ends_the_choice(mock_client: Any) -> None:
    base = {"model": MODEL, "messages": MESSAGES, "seed": 3, "temperature": 1.0}
    first = mock_client.chat.completions.create(
        max_tokens=16,
        extra_body={"ignore_eos": True},
        **base,
    )
    text = first.choices[0].message.content
    assert text
    assert len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    second = mock_client.chat.completions.create(
        max_tokens=16,
        stop=[stop],
        extra_body={"ignore_eos": True},
        **base,
    )
    assert second.choices[0].finish_reason == "stop"
    assert stop not in (second.choices[0].message.content or "")
    assert text.startswith(second.choices[0].message.content or "")


def test_completions_string_and_tokens(mock_client: Any) -> None:
    result = mock_client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert result.usage.completion_tokens == 4
    tok = TextTokenizer(TINY_TOKENIZER)
    ids = tok.encode("Once upon a time", True)
    assert result.usage.prompt_tokens == len(ids)
    by_ids = mock_client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, seed=1, extra_body={"ignore_eos": True}
    )
    by_text = mock_client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=4,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completions_batch_n_echo_and_logprobs(mock_client: Any) -> None:
    result = mock_client.completions.create(
        model=MODEL,
        prompt=["The sky is", "Grass is"],
        max_tokens=3,
        n=2,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for choice in result.choices:
        assert choice.logprobs is not None
        assert len(choice.logprobs.tokens or []) == 3
        assert "".join(choice.logprobs.tokens or []) == choice.text
        offsets = choice.logprobs.text_offset or []
        assert offsets == sorted(offsets)
        assert offsets[0] == 0
        for top in choice.logprobs.top_logprobs or []:
            assert 1 <= len(top) <= 3
    assert result.usage is not None
    assert result.usage.completion_tokens == 12
    echoed = mock_client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=2, echo=True, extra_body={"ignore_eos": True}
    )
    assert echoed.choices[0].text.startswith("The sky is")
    assert len(echoed.choices[0].text) > len("The sky is")


def test_completions_streaming(mock_client: Any) -> None:
    kwargs = {"model": MODEL, "prompt": ["a b c", "d e"], "max_tokens": 4, "seed": 5}
    whole = mock_client.completions.create(extra_body={"ignore_eos": True}, **kwargs)
    stream = mock_client.completions.create(
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **kwargs,
    )
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        assert chunk.object == "text_completion"
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        if chunk.usage is not None:
            usage = chunk.usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage is not None
    assert whole.usage is not None
    assert usage.model_dump() == whole.usage.model_dump()


def test_models_lists_served_name(mock_client: Any) -> None:
    models = mock_client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == MODEL
    assert mock_client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        mock_client.models.retrieve("nope")


def test_unknown_model_is_404(mock_client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        mock_client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found"
    assert body["param"] == "model"
