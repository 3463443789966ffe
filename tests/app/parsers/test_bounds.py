"""No model output can stall or crash the parsers.

Every tool-call and reasoning parser, streamed (one marker per delta, as the gateway feeds
it) and whole, spends CPU time linear in the length of any flood of its own markers and text
(see ``floods.py``): sixteen times the text takes about sixteen times the time, never the 256
times of a parser that rescans what it holds. And JSON nested far past any decoder's depth
parses without raising.
"""

from __future__ import annotations

from typing import Any

import pytest

from rankgate.app.parsers import ChoiceParser, Parsed, Vocabulary, vocabulary
from tests.app.parsers import floods
from tests.app.parsers.vocab import build_tokenizer
from tests.app.test_parsers import CASES, _plan

# One case per distinct plan: parsers, tool choice, tools or none.
PLANS = {(c.tool_parser, c.reasoning_parser, str(c.tool_choice), bool(c.tools)): c for c in CASES}
CALL = '{"name": "get_weather", "arguments": '
DEPTH = 5_000
STEP = 7
SUBJECTS = floods.subjects()


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Vocabulary]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = {"harmony": Vocabulary()}
    for family in {c.family for c in PLANS.values()} - {"harmony"}:
        out[family] = vocabulary(build_tokenizer(family, root))
    return out


def _drive(plan: Any, text: str) -> list[Parsed]:
    parser = ChoiceParser(plan)
    outs = [parser.feed(text[i : i + STEP]) for i in range(0, len(text), STEP)]
    outs.append(parser.finish())
    return outs


@pytest.mark.parametrize("subject", SUBJECTS, ids=[s.name for s in SUBJECTS])
def test_every_flood_of_a_parsers_markers_parses_in_linear_time(
    subject: floods.Subject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    plan = floods.plan(
        subject, floods.vocabulary_of(subject.family, tmp_path_factory.getbasetemp())
    )
    slow = []
    for what, unit in floods.floods(subject):
        small = floods.repeat(unit, floods.SIZE)
        for mode, pieces in (("streamed", small), ("whole", ["".join(small)])):
            ratio = floods.parse_growth(plan, pieces)
            if ratio >= floods.BOUND:
                slow.append(f"{what} {mode}: {ratio:.0f}x")
    assert not slow, f"{floods.GROWTH}x the text took: " + "; ".join(slow)


def _shape(outs: list[Parsed]) -> tuple[Any, ...]:
    calls = [call.name for out in outs for call in out.calls if call.name is not None]
    return (
        len(calls),
        any(out.content for out in outs),
        any(out.reasoning for out in outs),
    )


@pytest.mark.parametrize("key", list(PLANS), ids=lambda k: "-".join(map(str, k)))
def test_json_of_any_depth_is_read_as_a_call_that_does_not_parse(
    key: tuple[Any, ...], vocabs: dict[str, Vocabulary]
) -> None:
    """However deep, nested JSON ends as the format's output with an unparsable call ends
    (text, or a call with its arguments as given), never as an error."""
    case = PLANS[key]
    plan = _plan(case, vocabs[case.family])
    for marker in (*(getattr(plan.tools, "markers", ()) if plan.tools else ()), "", "</think>"):
        deep = _drive(plan, marker + CALL + "[" * DEPTH)
        broken = _drive(plan, marker + CALL + "@" * DEPTH)
        assert _shape(deep) == _shape(broken), repr(marker)
