"""Model outputs per format for the differential tests: the shapes real models write, and the
ways they go wrong (truncated, malformed, mixed with text, unicode, nesting, no call at all)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rankgate.app.parsers.json_calls import deepseek_token

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "object",
                    "properties": {
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "limit": {"type": "integer"},
                        "exact": {"type": "boolean"},
                    },
                },
            },
        },
    },
}
NOW: dict[str, Any] = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, SEARCH, NOW]

Call = tuple[str, dict[str, Any]]
PARIS: Call = ("get_weather", {"city": "Paris", "days": 3})
TOKYO: Call = ("get_weather", {"city": "東京", "unit": "c"})
NESTED: Call = (
    "search",
    {"query": 'naïve “quotes” \\ and "escapes"', "filters": {"tags": ["a", "b"], "limit": 5}},
)
EMPTY: Call = ("now", {})


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    tool_parser: str | None
    reasoning_parser: str | None
    text: str
    tools: list[dict[str, Any]] = field(default_factory=lambda: TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        return f"{self.tool_parser or '-'}+{self.reasoning_parser or '-'}:{self.name}"

    def spec(self, tokenizer: str, chunkings: list[int]) -> dict[str, Any]:
        return {
            "tokenizer": tokenizer,
            "tool_parser": self.tool_parser,
            "reasoning_parser": self.reasoning_parser,
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self.chat_template_kwargs,
            "text": self.text,
            "chunkings": chunkings,
        }


def _j(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def hermes(calls: list[Call]) -> str:
    return "\n".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {_j(a)}}}\n</tool_call>' for n, a in calls
    )


def llama_json(calls: list[Call]) -> str:
    return "; ".join(f'{{"name": "{n}", "parameters": {_j(a)}}}' for n, a in calls)


def _py(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    return repr(value)


def pythonic(calls: list[Call]) -> str:
    inner = ", ".join(
        n + "(" + ", ".join(f"{k}={_py(v)}" for k, v in a.items()) + ")" for n, a in calls
    )
    return f"[{inner}]"


def mistral(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{_j(a)}" for n, a in calls)


def mistral_old(calls: list[Call]) -> str:
    return "[TOOL_CALLS] " + json.dumps(
        [{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False
    )


DS_CALLS, DS_CALLS_END = deepseek_token("tool calls begin"), deepseek_token("tool calls end")
DS_CALL, DS_END, DS_SEP = (
    deepseek_token("tool call begin"),
    deepseek_token("tool call end"),
    deepseek_token("tool sep"),
)


def deepseek_v3(calls: list[Call]) -> str:
    body = "\n".join(
        f"{DS_CALL}function{DS_SEP}{n}\n```json\n{_j(a)}\n```{DS_END}" for n, a in calls
    )
    return f"{DS_CALLS}{body}{DS_CALLS_END}"


def deepseek_v31(calls: list[Call]) -> str:
    return (
        DS_CALLS + "".join(f"{DS_CALL}{n}{DS_SEP}{_j(a)}{DS_END}" for n, a in calls) + DS_CALLS_END
    )


def _xml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def qwen3_xml(calls: list[Call]) -> str:
    out = []
    for n, a in calls:
        params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in a.items())
        out.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
    return "\n".join(out)


def kimi(calls: list[Call]) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_j(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def glm(calls: list[Call]) -> str:
    out = []
    for n, a in calls:
        args = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(v)}</arg_value>\n"
            for k, v in a.items()
        )
        out.append(f"<tool_call>{n}\n{args}</tool_call>")
    return "\n".join(out)


def granite(calls: list[Call]) -> str:
    return "<|tool_call|>" + json.dumps(
        [{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False
    )


def xlam(calls: list[Call]) -> str:
    return json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def harmony(calls: list[Call]) -> str:
    return "".join(
        f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
        f"<|message|>{_j(a)}<|call|>"
        for n, a in calls
    )


def _cut(text: str, fraction: float = 0.6) -> str:
    return text[: int(len(text) * fraction)]


# tool parser -> (family, renderer, reasoning parser it ships with, how reasoning is written)
Renderer = Callable[[list[Call]], str]
THINK = ("<think>", "</think>")
FORMATS: dict[str, tuple[str, Renderer, str | None, tuple[str, str]]] = {
    "hermes": ("chatml", hermes, "qwen3", THINK),
    "llama3_json": ("llama", llama_json, None, THINK),
    "llama4_json": ("llama", lambda c: "<|python_tag|>" + llama_json(c), None, THINK),
    "pythonic": ("chatml", pythonic, None, THINK),
    "llama4_pythonic": (
        "llama4",
        lambda c: f"<|python_start|>{pythonic(c)}<|python_end|>",
        None,
        THINK,
    ),
    "mistral": ("mistral", mistral, "mistral", ("[THINK]", "[/THINK]")),
    "deepseek_v3": ("deepseek", deepseek_v3, "deepseek_r1", THINK),
    "deepseek_v31": ("deepseek", deepseek_v31, "deepseek_r1", THINK),
    "qwen3_coder": ("chatml", qwen3_xml, "qwen3", THINK),
    "qwen3_xml": ("chatml", qwen3_xml, "qwen3", THINK),
    "kimi_k2": ("kimi", kimi, None, THINK),
    "glm45": ("glm", glm, "glm45", THINK),
    "granite": ("granite", granite, None, THINK),
    "xlam": ("chatml", xlam, None, THINK),
}


def _format_cases(parser: str) -> list[Case]:
    family, render, reasoning, (open_, close) = FORMATS[parser]
    one = render([PARIS])
    two = render([PARIS, NESTED])
    cases = [
        ("single", one),
        ("parallel", two),
        ("three", render([PARIS, TOKYO, EMPTY])),
        ("text_then_call", "Let me check that for you.\n\n" + one),
        ("call_then_text", one + "\nDone."),
        ("unicode_nested", render([TOKYO, NESTED])),
        ("empty_arguments", render([EMPTY])),
        ("truncated", _cut(two)),
        ("truncated_early", _cut(one, 0.3)),
        ("malformed", one.replace('"city"', "city", 1).replace("city=", "city=)", 1)),
        ("no_call", "The weather in Paris is mild; {no call here}."),
        ("plain", "Hello! How can I help you today?"),
        ("blank", "  \n"),
    ]
    out = [Case(name, family, parser, None, text) for name, text in cases]
    if reasoning is not None:
        out += [
            Case(
                "think_call", family, parser, reasoning, f"{open_}\nNeed weather.\n{close}\n\n{one}"
            ),
            Case("think_text", family, parser, reasoning, f"{open_}Plan it.{close}Sure: {two}"),
            Case("think_empty", family, parser, reasoning, f"{open_}{close}Hi there."),
            Case("think_unclosed", family, parser, reasoning, f"{open_}still thinking about {one}"),
            Case("think_no_tags", family, parser, reasoning, "No tags at all, just words."),
        ]
    out += [
        Case("choice_none", family, parser, None, "Text. " + one, tool_choice="none"),
        Case("no_tools", family, parser, None, "Text. " + one, tools=[]),
        Case("single_call_only", family, parser, None, two, parallel_tool_calls=False),
    ]
    return out


def _harmony_cases() -> list[Case]:
    think = "<|channel|>analysis<|message|>Need the weather.<|end|>"
    final = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    one = harmony([PARIS])
    cases = [
        ("think_call", think + one),
        ("think_final", think + final),
        ("parallel", think + harmony([PARIS, NESTED])),
        ("final_only", "<|channel|>final<|message|>Just text.<|return|>"),
        (
            "two_thoughts",
            think + "<|start|>assistant<|channel|>analysis<|message|>More.<|end|>" + final,
        ),
        ("preamble", "<|channel|>commentary<|message|>Checking.<|end|>" + one),
        ("unicode_nested", harmony([TOKYO, NESTED])),
        ("truncated", _cut(think + one, 0.8)),
        ("think_unclosed", "<|channel|>analysis<|message|>thinking on and on"),
        ("header_cut", think + "<|start|>assistant<|channel|>fin"),
        ("bad_json", think + one.replace('"city"', "city")),
        ("plain", "no harmony markup at all"),
        ("empty_reasoning", "<|channel|>analysis<|message|><|end|>" + final),
    ]
    out = []
    for name, text in cases:
        out.append(Case(name, "harmony", "openai", "openai_gptoss", text))
    out += [
        Case("tools_only", "harmony", "openai", None, think + one),
        Case("reasoning_only", "harmony", None, "openai_gptoss", think + final),
        Case("choice_none", "harmony", "openai", "openai_gptoss", think + one, tool_choice="none"),
    ]
    return out


def _reasoning_cases() -> list[Case]:
    out: list[Case] = []
    think_texts = [
        ("closed", "<think>Let me think.\n</think>\n\nThe answer is 4."),
        ("empty", "<think></think>Just the answer."),
        ("unclosed", "<think>Thinking without an end"),
        ("no_start", "Reasoning first</think>answer after"),
        ("no_tags", "A plain answer."),
        ("prefix_then_think", "noise<think>real thought</think>answer"),
        ("late_think", "thought</think>answer <think>again</think>tail"),
        ("trailing_space", "<think>spaces after   \n</think>  answer  "),
        ("unicode", "<think>思考中…</think>答えは４です。"),
        ("special_tokens", "<think>a<|im_end|>b</think>c<|im_start|>d"),
        ("tool_in_reasoning", '<think>hmm <tool_call>{"name": "now", "arguments": {}}</tool_call>'),
    ]
    for parser in ("deepseek_r1", "qwen3", "glm45", "step3"):
        family = "glm" if parser == "glm45" else "chatml"
        out += [Case(name, family, None, parser, text) for name, text in think_texts]
    out.append(
        Case(
            "thinking_off",
            "chatml",
            None,
            "qwen3",
            "<think>x</think>y",
            chat_template_kwargs={"enable_thinking": False},
        )
    )
    out.append(
        Case(
            "thinking_off",
            "glm",
            None,
            "glm45",
            "<think>x</think>y",
            chat_template_kwargs={"thinking": False},
        )
    )
    granite_texts = [
        ("both", "Here is my thought process: think hard. Here is my response: 42"),
        ("heres", "Here's my thought process: a\nb\nHere's my response: c"),
        ("no_response", "Here is my thought process: still going"),
        ("none", "Just an answer."),
        ("prefix", "Intro. Here is my thought process: x Here is my response: y"),
    ]
    out += [Case(name, "granite", None, "granite", text) for name, text in granite_texts]
    mistral_texts = [
        ("closed", "[THINK]Let me see.[/THINK]The answer."),
        ("unclosed", "[THINK]still going"),
        ("none", "Plain answer."),
        ("call", "[THINK]Need weather.[/THINK]" + mistral([PARIS])),
        ("twice", "[THINK]a[/THINK]b[THINK]c[/THINK]d"),
    ]
    out += [Case(name, "mistral", None, "mistral", text) for name, text in mistral_texts]
    return out


def _extra_cases() -> list[Case]:
    old = "mistral_v7"
    return [
        Case("old_single", old, "mistral", None, mistral_old([PARIS])),
        Case("old_parallel", old, "mistral", None, "Sure. " + mistral_old([PARIS, NESTED])),
        Case("old_truncated", old, "mistral", None, _cut(mistral_old([PARIS, NESTED]))),
        Case("old_plain", old, "mistral", None, "No calls here."),
        Case("old_bad", old, "mistral", None, "Text [TOOL_CALLS] not json"),
        Case("kimi_think", "kimi", "kimi_k2", "deepseek_r1", "<think>hmm</think>" + kimi([PARIS])),
        Case("hermes_alone_think", "chatml", "hermes", None, "<think>x</think>" + hermes([PARIS])),
        Case(
            "qwen_no_reasoning_think",
            "chatml",
            "qwen3_coder",
            None,
            "<think>x</think>" + qwen3_xml([PARIS]),
        ),
        Case(
            "glm_unknown_tool",
            "glm",
            "glm45",
            "glm45",
            "<think>x</think>" + glm([("nope", {"a": 1}), PARIS]),
        ),
        Case("pythonic_positional", "chatml", "pythonic", None, "[get_weather('Paris')]"),
        Case("pythonic_dotted", "chatml", "pythonic", None, "[weather.get(city='Paris', ok=true)]"),
        Case("xlam_block", "chatml", "xlam", None, "Sure.\n```json\n" + xlam([PARIS]) + "\n```"),
        Case("xlam_think", "chatml", "xlam", None, "<think>hm</think>" + xlam([PARIS])),
        Case(
            "granite_text", "granite", "granite", None, "Sure.\n<tool_call>" + xlam([PARIS]) + " ok"
        ),
        Case(
            "required_pythonic",
            "chatml",
            "pythonic",
            None,
            pythonic([PARIS]),
            tool_choice="required",
        ),
        Case(
            "named_xlam",
            "chatml",
            "xlam",
            None,
            ' {"city": "Paris"}',
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
        Case(
            "required_granite",
            "granite",
            "granite",
            None,
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
            tool_choice="required",
        ),
        Case(
            "required_mistral", "mistral", "mistral", None, mistral([PARIS]), tool_choice="required"
        ),
        Case(
            "named_mistral_old",
            old,
            "mistral",
            None,
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
    ]


def all_cases() -> list[Case]:
    cases: list[Case] = []
    for parser in FORMATS:
        cases += _format_cases(parser)
    return cases + _harmony_cases() + _reasoning_cases() + _extra_cases()
