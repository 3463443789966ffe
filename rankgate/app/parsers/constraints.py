"""The structural tags vLLM's server sends the engine to hold tool calls to a format.

With ``VLLM_ENFORCE_STRICT_TOOL_CALLING`` on (vLLM's default), a parser that has a
structural-tag model gets its ``tool_choice`` enforced by an xgrammar structural tag in the
model's own syntax instead of a JSON schema: ``required`` and a named function always,
``auto`` when some tool is ``strict`` or parallel calls are off. A tool's arguments are held to
its schema only when it is ``strict``; otherwise any JSON object fits. The tags are built here
as the same JSON documents vLLM builds (checked against it by the differential tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from rankgate.app.parsers.json_calls import deepseek_token

Node = dict[str, Any]
Choice = Literal["auto", "required", "forced"]
# (name, parameters schema or True for any JSON)
Fn = tuple[str, Any]

_THINK_EXCLUDES = ["<think>", "</think>"]


def _tag(begin: str, content: Node, end: str | list[str]) -> Node:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _schema(schema: Any, style: str = "json") -> Node:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": style,
        "any_order": False,
        "max_whitespace_cnt": None,
        "excludes": [],
    }


def _const(value: str) -> Node:
    return {"type": "const_string", "value": value}


def _sequence(*elements: Node) -> Node:
    return {"type": "sequence", "elements": list(elements)}


def _any_text(excludes: list[str] | None = None) -> Node:
    return {"type": "any_text", "excludes": excludes or [], "max_tokens": None, "max_chars": None}


def _triggered(
    triggers: list[str],
    tags: list[Node],
    *,
    at_least_one: bool = False,
    excludes: list[str] | None = None,
) -> Node:
    return {
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "at_least_one": at_least_one,
        "stop_after_first": False,
        "excludes": excludes or [],
    }


def _separated(tags: list[Node], separator: str, *, forced: bool = False) -> Node:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": forced,
    }


def _hermes(tools: list[Fn], choice: Choice) -> Node:
    shapes = (
        ('<tool_call>\n{"name": "', "}\n</tool_call>"),
        ('<tool_call>{"name": "', "}</tool_call>"),
    )
    tags = [
        _tag(begin + name + '", "arguments": ', _schema(params), end)
        for name, params in tools
        for begin, end in shapes
    ]
    if choice == "auto":
        return _triggered(["<tool_call>"], tags) if tags else _any_text()
    return _separated(tags, "", forced=choice == "forced")


def _listed(
    tools: list[Fn], choice: Choice, trigger: str, tag_of: Callable[[Fn], Node], excludes: list[str]
) -> Node:
    """Formats whose calls are single tags found by a trigger (Llama JSON, Qwen XML)."""
    if choice == "forced":
        return tag_of(tools[0])
    tags = [tag_of(tool) for tool in tools]
    if choice == "auto" and not tags:
        return _any_text(excludes)
    return _triggered([trigger], tags, at_least_one=choice == "required", excludes=excludes)


def _llama(tools: list[Fn], choice: Choice) -> Node:
    def tag_of(tool: Fn) -> Node:
        return _tag('{"name": "' + tool[0] + '", "parameters": ', _schema(tool[1]), "}")

    return _listed(tools, choice, '{"name": ', tag_of, list(_THINK_EXCLUDES))


def _qwen_xml(tools: list[Fn], choice: Choice) -> Node:
    def tag_of(tool: Fn) -> Node:
        return _tag(
            "<tool_call>\n<function=" + tool[0] + ">\n",
            _schema(tool[1], "qwen_xml"),
            "\n</function>\n</tool_call>",
        )

    return _listed(tools, choice, "<tool_call>\n<function=", tag_of, list(_THINK_EXCLUDES))


def _sectioned(
    tools: list[Fn],
    choice: Choice,
    *,
    begin: str,
    end: str,
    call: Callable[[Fn], Node],
    forced: Callable[[Fn], Node],
    separator: str,
    excludes: list[str],
) -> Node:
    """Formats whose calls sit in a section with its own begin and end markers."""
    if choice == "forced":
        return forced(tools[0])
    calls = _separated([call(tool) for tool in tools], separator)
    if choice == "required":
        return calls
    return _triggered([begin], [_tag(begin, calls, end)], excludes=excludes)


_KIMI_BEGIN, _KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def _kimi_call(tool: Fn) -> Node:
    return _tag(
        "<|tool_call_begin|>functions." + tool[0] + ":",
        _sequence(
            {"type": "regex", "pattern": "\\d+"},
            _const("<|tool_call_argument_begin|>"),
            _schema(tool[1]),
        ),
        "<|tool_call_end|>",
    )


def _kimi(tools: list[Fn], choice: Choice) -> Node:
    if choice == "forced":
        return _sequence(_const(_KIMI_BEGIN), _kimi_call(tools[0]), _const(_KIMI_END))
    calls = _separated([_kimi_call(tool) for tool in tools], "")
    if choice == "required":
        return _sequence(_const(_KIMI_BEGIN), calls, _const(_KIMI_END))
    return _triggered(
        [_KIMI_BEGIN],
        [_tag(_KIMI_BEGIN, calls, _KIMI_END)],
        excludes=[*_THINK_EXCLUDES, "<|tool_call_begin|>"],
    )


_DS = {
    name: deepseek_token(name.replace("_", " "))
    for name in (
        "tool_calls_begin",
        "tool_calls_end",
        "tool_call_begin",
        "tool_call_end",
        "tool_sep",
    )
}


def _deepseek(tools: list[Fn], choice: Choice, *, v31: bool) -> Node:
    call_begin, sep, call_end = _DS["tool_call_begin"], _DS["tool_sep"], _DS["tool_call_end"]
    begin, end = _DS["tool_calls_begin"], _DS["tool_calls_end"]

    def head(name: str) -> str:
        return (
            call_begin + name + sep if v31 else call_begin + "function" + sep + name + "\n```json\n"
        )

    tail = call_end if v31 else "\n```" + call_end

    def call(tool: Fn) -> Node:
        return _tag(head(tool[0]), _schema(tool[1]), tail)

    def forced(tool: Fn) -> Node:
        return _tag(begin + head(tool[0]), _schema(tool[1]), tail + end)

    calls = _separated([call(tool) for tool in tools], "" if v31 else "\n")
    if choice == "forced":
        return forced(tools[0])
    section = _tag(begin, calls, end)
    if choice == "required":
        return section
    return _triggered([begin], [section], excludes=list(_THINK_EXCLUDES))


_HARMONY_END = ["<|end|>", ""]
_HARMONY_CHANNELS = ("<|channel|>commentary", "<|channel|>analysis", "<|channel|>final")
_HARMONY_CONSTRAINS = (" json", " <|constrain|>json")


def _harmony(tools: list[Fn], choice: Choice) -> Node:
    tags = [
        _tag(
            pattern.format(name=name, channel=channel, constrain=constrain),
            _schema(params),
            _HARMONY_END,
        )
        for name, params in tools
        for pattern in (
            " to=functions.{name}{channel}{constrain}<|message|>",
            "{channel} to=functions.{name}{constrain}<|message|>",
        )
        for constrain in _HARMONY_CONSTRAINS
        for channel in _HARMONY_CHANNELS
    ]
    if choice == "auto":
        tags += [
            _tag(f"<|channel|>final{constrain}<|message|>", _any_text(), _HARMONY_END)
            for constrain in (*_HARMONY_CONSTRAINS, "")
        ]

    def preamble(channel: str) -> Node:
        return {
            "type": "optional",
            "content": _sequence(
                _tag(f"<|channel|>{channel}<|message|>", _any_text(), "<|end|>"),
                _const("<|start|>assistant"),
            ),
        }

    return _sequence(preamble("analysis"), preamble("commentary"), {"type": "or", "elements": tags})


BUILDERS: dict[str, Callable[[list[Fn], Choice], Node]] = {
    "hermes": _hermes,
    "qwen3_json": _hermes,
    "llama3_json": _llama,
    "llama4_json": _llama,
    "qwen3_coder": _qwen_xml,
    "qwen3_xml": _qwen_xml,
    "kimi_k2": _kimi,
    "deepseek_v3": lambda tools, choice: _deepseek(tools, choice, v31=False),
    "deepseek_v31": lambda tools, choice: _deepseek(tools, choice, v31=True),
    "openai": _harmony,
}


def _single(node: Any) -> None:
    """Let every list of calls stop after its first (parallel_tool_calls false)."""
    if isinstance(node, dict):
        if node.get("type") in ("triggered_tags", "tags_with_separator"):
            node["stop_after_first"] = True
        for value in node.values():
            _single(value)
    elif isinstance(node, list):
        for item in node:
            _single(item)


def structural_tag(
    tool_parser: str,
    tools: list[tuple[str, dict[str, Any] | None, bool]],
    choice: str,
    named: str | None,
    single: bool,
) -> dict[str, Any] | None:
    """vLLM's structural tag for this request, or None when it sends none.

    ``tools`` are (name, parameters, strict); ``choice`` is "auto", "required" or "named".
    """
    builder = BUILDERS.get(tool_parser)
    if builder is None or not tools:
        return None
    if choice == "auto" and not single and not any(strict for _, _, strict in tools):
        return None
    simplified: Choice = "auto" if choice == "auto" else "required"
    if choice == "named":
        tools = [t for t in tools if t[0] == named]
        simplified = "forced"
    fns = [
        (name, params if strict and params is not None else True) for name, params, strict in tools
    ]
    node = builder(fns, simplified)
    if single:
        _single(node)
    return {"type": "structural_tag", "format": node}
