"""Reasoning and tool-call parsing give the same result however the text is split."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from app.respond.parsers import ChoiceParser, OutputPlan, Parsed

TEXT = (
    "<think>Need the weather.</think>Checking <b>now</b>.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def run(plan: OutputPlan, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], str | None]:
    parser = ChoiceParser(plan)
    outs: list[Parsed] = [parser.feed(p) for p in pieces]
    outs.append(parser.finish())
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for out in outs:
        for call in out.calls:
            if call.name is not None:
                names[call.index] = call.name
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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_split_invariance(cuts: list[int]) -> None:
    plan = OutputPlan(reasoning_starts_inside=False, tool_calls=True)
    assert run(plan, split(TEXT, cuts)) == run(plan, [TEXT])


def test_full_parse() -> None:
    reasoning, content, calls, finish = run(
        OutputPlan(reasoning_starts_inside=False, tool_calls=True), [TEXT]
    )
    assert reasoning == "Need the weather."
    assert content == "Checking <b>now</b>.\n"
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert finish == "tool_calls"


def test_deepseek_r1_starts_inside_and_qwen3_does_not() -> None:
    text = "thinking hard</think>answer"
    assert run(OutputPlan(reasoning_starts_inside=True), [text])[:2] == ("thinking hard", "answer")
    assert run(OutputPlan(reasoning_starts_inside=False), [text])[:2] == ("", text)


def test_broken_call_stays_content() -> None:
    text = '<tool_call>{not json}</tool_call> and <tool_call>{"name": 1}'
    _, content, calls, finish = run(OutputPlan(tool_calls=True), [text])
    assert content == text
    assert calls == []
    assert finish == "stop"


def test_unclosed_call_at_end_is_parsed() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}'
    _, content, calls, _ = run(OutputPlan(tool_calls=True), split(text, [5, 17]))
    assert content == ""
    assert calls == [("f", '{"a":1}')]


def test_named_forced_call_streams_arguments() -> None:
    _, content, calls, finish = run(OutputPlan(forced_name="f"), ['{"a":', " 1}"])
    assert content == ""
    assert calls == [("f", '{"a": 1}')]
    assert finish == "stop"
