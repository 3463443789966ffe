"""Reasoning and tool-call parsing gives the same answer however the text is split.

The differential suite (tests/app/parsers/test_vllm_parity.py) pins each format to vLLM's
own parsers; these tests need no vLLM: every corpus output, split at random characters, must
stream to exactly its whole-output answer, and the public plan must follow ``tool_choice``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankgate.app.parsers import (
    ChoiceParser,
    Parsed,
    Tool,
    Vocabulary,
    canonical_reasoning_parser,
    canonical_tool_parser,
    plan_for,
    required_schema,
    vocabulary,
)
from tests.app.parsers.corpus import Case, all_cases
from tests.app.parsers.vocab import build_tokenizer

CASES = all_cases()
WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Vocabulary]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = {"harmony": Vocabulary()}
    for family in {c.family for c in CASES} - {"harmony"}:
        out[family] = vocabulary(build_tokenizer(family, root))
    return out


def _plan(case: Case, vocab: Vocabulary) -> Any:
    named = None
    choice = case.tool_choice
    if isinstance(choice, dict):
        named, choice = choice["function"]["name"], None
    tools = [Tool(t["function"]["name"], t["function"].get("parameters")) for t in case.tools]
    return plan_for(
        canonical_tool_parser(case.tool_parser) if case.tool_parser else None,
        canonical_reasoning_parser(case.reasoning_parser) if case.reasoning_parser else None,
        vocab,
        tools=tools or None,
        tool_choice=choice,
        named=named,
        parallel_tool_calls=case.parallel_tool_calls,
        template_kwargs=case.chat_template_kwargs or {},
    ).plan


def run(plan: Any, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], str | None]:
    parser = ChoiceParser(plan)
    outs: list[Parsed] = [parser.feed(p) for p in pieces]
    outs.append(parser.finish())
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for out in outs:
        for call in out.calls:
            if call.name is not None:
                assert call.id, "a call starts with its id"
                assert call.index not in names, "a call starts once"
                names[call.index] = call.name
            else:
                assert call.index in names, "arguments follow their call's start"
            args[call.index] = args.get(call.index, "") + call.arguments
    calls = [(names[i], args[i]) for i in sorted(names)]
    return (
        "".join(o.reasoning for o in outs),
        "".join(o.content for o in outs),
        calls,
        parser.finish_reason("stop"),
    )


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_streaming_adds_up_to_the_whole(
    case: Case, vocabs: dict[str, Vocabulary], cuts: list[int]
) -> None:
    plan = _plan(case, vocabs[case.family])
    assert run(plan, split(case.text, cuts)) == run(plan, [case.text])


def test_every_character_its_own_delta(vocabs: dict[str, Vocabulary]) -> None:
    for case in CASES:
        if case.family == "harmony":
            continue
        plan = _plan(case, vocabs[case.family])
        assert run(plan, list(case.text)) == run(plan, [case.text]), case.id


def _hermes(vocab: Vocabulary, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "tools": [WEATHER],
        "tool_choice": "auto",
        "named": None,
        "parallel_tool_calls": None,
        "template_kwargs": {},
    }
    args.update(kw)
    return plan_for("hermes", "qwen3", vocab, **args)


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_hermes_with_qwen3_reasoning() -> None:
    plan = _hermes(Vocabulary()).plan
    text = "<think>Need the weather.</think>Checking.\n" + CALL + CALL
    reasoning, content, calls, finish = run(plan, split(text, [3, 40, 61]))
    assert reasoning == "Need the weather."
    assert content == "Checking.\n"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})] * 2
    assert finish == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    plan = _hermes(Vocabulary(), parallel_tool_calls=False).plan
    assert len(run(plan, [CALL + CALL])[2]) == 1


def test_tool_choice_none_leaves_calls_as_text() -> None:
    plan = _hermes(Vocabulary(), tool_choice="none").plan
    assert run(plan, [CALL]) == ("", CALL, [], "stop")


def _pythonic(vocab: Vocabulary, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "tools": [WEATHER],
        "tool_choice": None,
        "named": None,
        "parallel_tool_calls": None,
        "template_kwargs": {},
    }
    args.update(kw)
    return plan_for("pythonic", "qwen3", vocab, **args)


def test_named_choice_streams_arguments_under_a_schema() -> None:
    """Formats on vLLM's generic path (no structural tag) hold the output to the function's
    parameters and read it as its arguments."""
    result = _pythonic(Vocabulary(), named="get_weather")
    assert result.schema == WEATHER.parameters
    assert result.structural_tag is None
    _, content, calls, finish = run(result.plan, ["<think>x</think>", '{"city":', ' "Paris"}'])
    assert content == ""
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert finish == "stop"


def test_required_choice_reads_the_json_array() -> None:
    result = _pythonic(Vocabulary(), tool_choice="required", parallel_tool_calls=False)
    assert result.schema == required_schema([WEATHER], single=True)
    assert result.schema["maxItems"] == 1
    text = '<think></think>[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    _, content, calls, finish = run(result.plan, split(text, [7, 30, 50]))
    assert (content, calls, finish) == ("", [("get_weather", '{"city": "Paris"}')], "tool_calls")


def test_hermes_required_is_a_structural_tag_and_parsed_from_the_format() -> None:
    """With vLLM's strict tool calling, a forcing tool_choice holds the model to its own
    call syntax (a structural tag) and the output is read like ``auto``."""
    result = _hermes(Vocabulary(), tool_choice="required")
    assert result.schema is None
    tag = result.structural_tag
    assert tag is not None
    assert tag["format"]["type"] == "tags_with_separator"
    assert tag["format"]["at_least_one"] is True
    begins = [t["begin"] for t in tag["format"]["tags"]]
    assert begins == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>{"name": "get_weather", "arguments": ',
    ]
    # Not strict: any JSON arguments fit.
    assert all(t["content"]["json_schema"] is True for t in tag["format"]["tags"])
    _, _, calls, finish = run(result.plan, ["<think></think>", CALL])
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls"


def test_auto_needs_no_constraint_unless_strict_or_single() -> None:
    assert _hermes(Vocabulary()).structural_tag is None
    single = _hermes(Vocabulary(), parallel_tool_calls=False).structural_tag
    assert single is not None
    assert single["format"]["stop_after_first"] is True
    strict = Tool("get_weather", WEATHER.parameters, strict=True)
    tag = _hermes(Vocabulary(), tools=[strict]).structural_tag
    assert tag is not None
    assert tag["format"]["tags"][0]["content"]["json_schema"] == WEATHER.parameters


def test_required_schema_lifts_defs_and_fills_empty_parameters() -> None:
    shared = {"$defs": {"Unit": {"enum": ["c", "f"]}}, "type": "object"}
    schema = required_schema([Tool("a", shared), Tool("b", None)])
    assert schema["$defs"] == {"Unit": {"enum": ["c", "f"]}}
    items = schema["items"]["anyOf"]
    assert items[0]["properties"]["parameters"] == {"type": "object"}
    assert items[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in schema
    assert shared["$defs"], "the request's own schema is left alone"


def test_unknown_names_are_not_parsers() -> None:
    assert canonical_tool_parser("qwen25") == "hermes"
    assert canonical_tool_parser("nope") is None
    assert canonical_reasoning_parser("think") == "qwen3"
    assert canonical_reasoning_parser("kimi_k3") is None


def test_vocabulary_reads_markers_and_special_tokens(tmp_path: Path) -> None:
    vocab = vocabulary(build_tokenizer("mistral", tmp_path))
    assert vocab.has("[ARGS]")
    assert vocab.has("[THINK]")
    assert "<|im_end|>" in vocab.special
    assert "[ARGS]" not in vocab.special, "added tokens are not transformers' special tokens"
