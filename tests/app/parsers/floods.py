"""Outputs built to make a parser work hard, and the CPU time a parser spends on them.

For every parser vLLM names, its own markers (and the JSON or Python syntax it reads) make
the alphabet of the floods: each marker repeated, every two markers interleaved, and the
format's own call with one of its markers left out (a closer, a separator), repeated. Each
flood is built at two sizes, sixteen times apart, as pieces the way the gateway feeds a parser
(one marker per delta, as a model emits it: one token).
"""

from __future__ import annotations

import gc
import itertools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankgate.app.parsers import (
    REASONING_PARSERS,
    ChoiceParser,
    Tool,
    Vocabulary,
    plan_for,
    vocabulary,
)
from rankgate.app.parsers.registry import TOOL_PARSERS
from tests.app.parsers import corpus
from tests.app.parsers.corpus import DS_CALL, DS_CALLS, DS_CALLS_END, DS_END, DS_SEP, PARIS
from tests.app.parsers.vocab import build_tokenizer

GROWTH = 16
# Linear is GROWTH times the time; a parser that rescans what it holds takes GROWTH squared.
BOUND = 40
# Characters of the smaller flood.
SIZE = 64
TEXT = (" ", "\n")
WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})

_JSON = ("{", "}", '"')
_HARMONY = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)
_DEEPSEEK = (DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END)
_QWEN = (
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    ">",
)
_GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_PYTHONIC = ("[", "]", "get_weather(", "city=", ")", ",")


@dataclass(frozen=True)
class Format:
    """A parser under test: the tokenizer family it runs with, and its alphabet."""

    family: str
    markers: tuple[str, ...]
    # The format's own output for one call (empty: the markers in order make one).
    call: str = ""


TOOL_FORMATS: dict[str, Format] = {
    "hermes": Format("chatml", ("<tool_call>", "</tool_call>", *_JSON), corpus.hermes([PARIS])),
    "qwen3_json": Format("chatml", ("<tool_call>", "</tool_call>", *_JSON), corpus.hermes([PARIS])),
    "llama3_json": Format("llama", ("<|python_tag|>", *_JSON, ";"), corpus.llama_json([PARIS])),
    "llama4_json": Format("llama", ("<|python_tag|>", *_JSON, ";"), corpus.llama_json([PARIS])),
    "pythonic": Format("chatml", _PYTHONIC, corpus.pythonic([PARIS])),
    "llama4_pythonic": Format(
        "llama4",
        ("<|python_start|>", "<|python_end|>", *_PYTHONIC),
        "<|python_start|>" + corpus.pythonic([PARIS]) + "<|python_end|>",
    ),
    "mistral": Format(
        "mistral",
        ("[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]", *_JSON),
        corpus.mistral([PARIS]),
    ),
    "deepseek_v3": Format(
        "deepseek", (*_DEEPSEEK, "\n```json\n", "\n```"), corpus.deepseek_v3([PARIS])
    ),
    "deepseek_v31": Format("deepseek", _DEEPSEEK, corpus.deepseek_v31([PARIS])),
    "qwen3_coder": Format("chatml", _QWEN, corpus.qwen3_xml([PARIS])),
    "qwen3_xml": Format("chatml", _QWEN, corpus.qwen3_xml([PARIS])),
    "kimi_k2": Format(
        "kimi",
        (
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            "{",
        ),
        corpus.kimi([PARIS]),
    ),
    "glm45": Format("glm", _GLM, corpus.glm([PARIS])),
    "glm47": Format("glm", _GLM, corpus.glm([PARIS])),
    "granite": Format(
        "granite", ("<|tool_call|>", "<tool_call>", "[", "]", *_JSON, "\\"), corpus.granite([PARIS])
    ),
    "xlam": Format(
        "chatml",
        ("```", "```json", "[TOOL_CALLS]", "<tool_call>", "</tool_call>", "</think>", "[", "{"),
        corpus.xlam([PARIS]),
    ),
    "openai": Format("harmony", _HARMONY, corpus.harmony([PARIS])),
}
# Mistral's tokenizers before v11 read calls as one JSON array (another syntax, same name).
OLD_MISTRAL = Format("mistral_v7", ("[TOOL_CALLS]", "[", "]", *_JSON), corpus.mistral_old([PARIS]))
_THINK = ("<think>", "</think>")
REASONING_FORMATS: dict[str, Format] = {
    "deepseek_r1": Format("deepseek", _THINK),
    "step3": Format("step3", _THINK),
    "qwen3": Format("chatml", (*_THINK, "<tool_call>")),
    "glm45": Format("glm", (*_THINK, "<tool_call>")),
    "glm47": Format("glm", (*_THINK, "<tool_call>")),
    "mistral": Format("mistral", ("[THINK]", "[/THINK]", "[TOOL_CALLS]")),
    "granite": Format(
        "granite", ("Here is my thought process:", "Here's my response:", "Here is my response:")
    ),
    "openai_gptoss": Format("harmony", _HARMONY),
}
assert set(TOOL_FORMATS) == set(TOOL_PARSERS)
assert set(REASONING_FORMATS) == set(REASONING_PARSERS)


@dataclass(frozen=True)
class Subject:
    """One parser to flood: a plan and the alphabet of its floods."""

    name: str
    family: str
    tool_parser: str | None
    reasoning_parser: str | None
    markers: tuple[str, ...]
    call: tuple[str, ...]


def subjects() -> list[Subject]:
    """Every tool-call and every reasoning parser vLLM names (both Mistral syntaxes)."""
    out = [
        Subject(f"tool-{name}", f.family, name, None, f.markers, _pieces(f.call, f.markers))
        for name, f in TOOL_FORMATS.items()
    ]
    old = OLD_MISTRAL
    out.append(
        Subject(
            "tool-mistral-v7",
            old.family,
            "mistral",
            None,
            old.markers,
            _pieces(old.call, old.markers),
        )
    )
    for name, f in REASONING_FORMATS.items():
        call = (f.markers[0], "thought", *f.markers[1:2], "answer")
        out.append(Subject(f"reasoning-{name}", f.family, None, name, f.markers, call))
    return out


def _pieces(text: str, markers: tuple[str, ...]) -> tuple[str, ...]:
    """``text`` as a model streams it: each marker one piece, the text between in short ones."""
    ordered = sorted(markers, key=len, reverse=True)
    split = re.split("(" + "|".join(map(re.escape, ordered)) + ")", text)
    pieces: list[str] = []
    for part in split:
        if part in markers:
            pieces.append(part)
        else:
            pieces += [part[i : i + 4] for i in range(0, len(part), 4)]
    return tuple(pieces)


def floods(subject: Subject) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(what it is, one repeat of it as pieces): each marker alone, every two interleaved, and
    the format's call missing one of its markers."""
    alphabet = (*subject.markers, *TEXT)
    for marker in alphabet:
        yield f"{marker!r}", (marker,)
    for first, second in itertools.combinations(alphabet, 2):
        yield f"{first!r}+{second!r}", (first, second)
    for i, piece in enumerate(subject.call):
        if piece in subject.markers:
            yield f"call without {piece!r}", subject.call[:i] + subject.call[i + 1 :]


def repeat(unit: tuple[str, ...], size: int) -> list[str]:
    return list(unit) * max(1, size // max(1, len("".join(unit))))


_VOCABULARIES: dict[str, Vocabulary] = {}


def vocabulary_of(family: str, root: Path) -> Vocabulary:
    if family == "harmony":
        return Vocabulary()
    if family not in _VOCABULARIES:
        _VOCABULARIES[family] = vocabulary(build_tokenizer(family, root))
    return _VOCABULARIES[family]


def plan(subject: Subject, vocab: Vocabulary) -> Any:
    tools = [WEATHER] if subject.tool_parser else None
    return plan_for(
        subject.tool_parser,
        subject.reasoning_parser,
        vocab,
        tools=tools,
        tool_choice="auto" if tools else None,
        named=None,
        parallel_tool_calls=None,
        template_kwargs={},
    ).plan


def drive(output_plan: Any, pieces: list[str]) -> None:
    parser = ChoiceParser(output_plan)
    for piece in pieces:
        parser.feed(piece)
    parser.finish()


def cpu(work: Callable[[], object]) -> float:
    """The CPU time ``work`` takes on this thread (the collector held off meanwhile)."""
    gc.disable()
    try:
        started = time.thread_time()
        work()
        return time.thread_time() - started
    finally:
        gc.enable()


def growth(
    small: Callable[[], float], large: Callable[[], float], tries: int = 4, samples: int = 3
) -> float:
    """How many times the seconds ``small`` reports (the least of ``samples``) ``large``
    reports, the least of a few tries: a busy machine only ever adds time, so a high ratio is
    measured again before it counts."""
    best = float("inf")
    for _ in range(tries):
        base = min(small() for _ in range(samples))
        best = min(best, large() / max(base, 1e-5))
        if best < BOUND:
            break
    return best


def parse_growth(output_plan: Any, small: list[str], tries: int = 4) -> float:
    """:func:`growth` of the CPU time a parser takes over ``small`` and its sixteen-fold."""
    large = small * GROWTH
    return growth(
        lambda: cpu(lambda: drive(output_plan, small)),
        lambda: cpu(lambda: drive(output_plan, large)),
        tries,
    )
