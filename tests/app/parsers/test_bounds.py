"""No model output can stall or crash the parsers: for every parser plan the corpus uses,
adversarial outputs (long runs of the format's markers without their closers, JSON nested far
past any decoder's depth) parse without raising, and the CPU time they take grows at most
linearly with their length (eight times the text: well under the 64 times of a parser that
rescans what it holds at every delta).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from rankgate.app.parsers import ChoiceParser, Parsed, Vocabulary, vocabulary
from tests.app.parsers.vocab import build_tokenizer
from tests.app.test_parsers import CASES, _plan

# One case per distinct plan: parsers, tool choice, tools or none.
PLANS = {(c.tool_parser, c.reasoning_parser, str(c.tool_choice), bool(c.tools)): c for c in CASES}
GENERIC = ("</think>", "<tool_call>", "{")
CALL = '{"name": "get_weather", "arguments": '
DEPTH = 5_000
STEP = 7
SIZE = 1_000
GROWTH = 8
# Linear is GROWTH times; quadratic would be GROWTH squared.
BOUND = 3 * GROWTH


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


def _cpu(plan: Any, text: str) -> float:
    started = time.thread_time()
    _drive(plan, text)
    return time.thread_time() - started


def _hostile(plan: Any) -> list[str]:
    markers = tuple(getattr(plan.tools, "markers", ()) or ()) if plan.tools else ()
    return [*(body for m in markers for body in (m, m + "[")), *(m + "[" for m in GENERIC)]


@pytest.mark.parametrize("key", list(PLANS), ids=lambda k: "-".join(map(str, k)))
def test_adversarial_outputs_parse_in_linear_time(
    key: tuple[Any, ...], vocabs: dict[str, Vocabulary]
) -> None:
    case = PLANS[key]
    plan = _plan(case, vocabs[case.family])
    for body in _hostile(plan):
        small = body * (SIZE // len(body) + 1)
        large = small * GROWTH
        # A busy machine only ever adds time: a high ratio is measured again.
        ratio = float("inf")
        for _ in range(3):
            ratio = min(ratio, _cpu(plan, large) / max(_cpu(plan, small), 1e-4))
            if ratio < BOUND:
                break
        assert ratio < BOUND, f"{body!r} repeated: {GROWTH}x the text took {ratio:.0f}x the time"


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
