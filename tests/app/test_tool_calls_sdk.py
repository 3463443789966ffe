"""Tool calls end to end through the gateway with the official OpenAI SDK, per parser.

Each gateway fronts a scripted engine that answers in one model family's own format, token by
token of that family's tokenizer; the SDK must see the same calls, content and reasoning
streamed and not, with the family's call ids and OpenAI's streaming shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from tests.app.parsers.corpus import (
    WEATHER,
    deepseek_v3,
    harmony,
    hermes,
    kimi,
    llama_json,
    mistral,
    qwen3_xml,
)
from tests.app.parsers.vocab import build_tokenizer
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app

TOOLS = [WEATHER]
USER = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
PARIS = ("get_weather", {"city": "Paris", "days": 3})
TOKYO = ("get_weather", {"city": "東京", "unit": "c"})
VLLM_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")


@dataclass(frozen=True)
class Family:
    tool_parser: str
    reasoning_parser: str
    tokenizer: str
    output: str
    reasoning: str | None
    content: str | None
    id_pattern: re.Pattern[str]


FAMILIES = [
    Family(
        "hermes",
        "qwen3",
        "chatml",
        "<think>Two cities.</think>On it.\n" + hermes([PARIS, TOKYO]),
        "Two cities.",
        "On it.\n",
        VLLM_ID,
    ),
    Family("llama3_json", "", "llama", llama_json([PARIS, TOKYO]), None, None, VLLM_ID),
    Family(
        "mistral",
        "mistral",
        "mistral",
        "[THINK]Two cities.[/THINK]Checking. " + mistral([PARIS, TOKYO]),
        "Two cities.",
        "Checking.",
        re.compile(r"[A-Za-z0-9]{9}"),
    ),
    Family(
        "qwen3_coder",
        "qwen3",
        "chatml",
        "<think>\nTwo cities.\n</think>\n\nSure.\n" + qwen3_xml([PARIS, TOKYO]),
        "\nTwo cities.\n",
        "Sure.",
        VLLM_ID,
    ),
    Family(
        "openai",
        "openai_gptoss",
        "gptoss",
        "<|channel|>analysis<|message|>Two cities.<|end|>" + harmony([PARIS, TOKYO]),
        "Two cities.",
        None,
        VLLM_ID,
    ),
    Family(
        "kimi_k2",
        "",
        "kimi",
        "Checking. " + kimi([PARIS, TOKYO]),
        None,
        "Checking. ",
        re.compile(r"functions\.get_weather:[01]"),
    ),
    Family(
        "deepseek_v3",
        "deepseek_r1",
        "deepseek",
        "<think>Two cities.</think>" + deepseek_v3([PARIS, TOKYO]),
        "Two cities.",
        None,
        VLLM_ID,
    ),
]


@pytest.fixture(scope="module")
def tokenizer_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sdk-tokenizers")


@pytest.fixture(params=FAMILIES, ids=[f.tool_parser for f in FAMILIES])
def family_client(
    request: pytest.FixtureRequest, tokenizer_root: Path
) -> Iterator[tuple[Family, ScriptedEngine, openai.OpenAI]]:
    family: Family = request.param
    directory = build_tokenizer(family.tokenizer, tokenizer_root)
    info = scripted_info(
        directory, tool_parser=family.tool_parser, reasoning=family.reasoning_parser
    )
    engine = ScriptedEngine(info, directory)
    engine.outputs = [family.output]
    with (
        serve_app(create_app(GatewaySettings(), engine=engine)) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield family, engine, client


def _expected_calls() -> list[tuple[str, dict[str, Any]]]:
    return [PARIS, TOKYO]


def test_non_streamed_tool_calls(family_client: Any) -> None:
    family, engine, client = family_client
    result = client.chat.completions.create(model=SCRIPTED_MODEL, messages=USER, tools=TOOLS)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == family.content
    assert getattr(message, "reasoning_content", None) == family.reasoning
    calls = message.tool_calls
    assert calls is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == _expected_calls()
    for call in calls:
        assert call.type == "function"
        assert family.id_pattern.fullmatch(call.id), call.id
    assert len({c.id for c in calls}) == 2
    # Special tokens are kept where vLLM's parser keeps them (its markers may be special).
    keeps = family.tool_parser not in ("llama3_json", "deepseek_v3")
    assert engine.requests[-1].output.skip_special_tokens is not keeps


def test_streamed_tool_calls(family_client: Any) -> None:
    family, _, client = family_client
    chunks = list(
        client.chat.completions.create(
            model=SCRIPTED_MODEL, messages=USER, tools=TOOLS, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas) or None
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) or None
    assert content == family.content
    assert reasoning == family.reasoning
    entries = [t for d in deltas for t in d.tool_calls or []]
    # OpenAI's shape: one entry per delta; a call's id, type and name first, then arguments.
    assert all(len(d.tool_calls or []) <= 1 for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for entry in entries:
        assert entry.function is not None
        if entry.index not in calls:
            assert entry.id is not None
            assert entry.type == "function"
            assert entry.function.name
            assert family.id_pattern.fullmatch(entry.id), entry.id
            calls[entry.index] = {"name": entry.function.name, "arguments": ""}
        else:
            assert entry.id is None
            assert entry.function.name is None
        calls[entry.index]["arguments"] += entry.function.arguments or ""
    assert sorted(calls) == [0, 1]
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert got == _expected_calls()
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["tool_calls"]


def test_sdk_accumulates_the_stream(family_client: Any) -> None:
    """The SDK's own stream helper builds the same message as the non-streamed answer."""
    _, _, client = family_client
    with client.chat.completions.stream(model=SCRIPTED_MODEL, messages=USER, tools=TOOLS) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    whole = client.chat.completions.create(model=SCRIPTED_MODEL, messages=USER, tools=TOOLS)
    streamed_calls = final.choices[0].message.tool_calls or []
    whole_calls = whole.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole_calls
    ]
    assert (final.choices[0].message.content or None) == whole.choices[0].message.content


def test_parallel_tool_calls_false_returns_one_call(family_client: Any) -> None:
    _, _, client = family_client
    result = client.chat.completions.create(
        model=SCRIPTED_MODEL, messages=USER, tools=TOOLS, parallel_tool_calls=False
    )
    calls = result.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [PARIS]


def test_tool_choice_none_returns_no_calls(family_client: Any) -> None:
    _, _, client = family_client
    result = client.chat.completions.create(
        model=SCRIPTED_MODEL, messages=USER, tools=TOOLS, tool_choice="none"
    )
    assert not result.choices[0].message.tool_calls
    assert result.choices[0].finish_reason == "stop"
