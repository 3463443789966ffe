"""Parser names as vLLM spells them, and the per-request plan built from them.

Names come from Control's ``ModelInfo`` (or the operator's flags). A few older Rankgate names
are kept as aliases; anything else is unknown, and the gateway then returns plain text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from rankgate.app.parsers import json_calls, markup_formats, reasoning
from rankgate.app.parsers.choice import (
    OutputPlan,
    mistral_call_id,
    vllm_call_id,
    xlam_call_id,
)
from rankgate.app.parsers.constraints import structural_tag
from rankgate.app.parsers.types import (
    ReasoningSplitter,
    ToolContext,
    ToolSyntax,
    Vocabulary,
)

TOOL_PARSERS = (
    "deepseek_v3",
    "deepseek_v31",
    "glm45",
    "glm47",
    "granite",
    "hermes",
    "kimi_k2",
    "llama3_json",
    "llama4_json",
    "llama4_pythonic",
    "mistral",
    "openai",
    "pythonic",
    "qwen3_coder",
    "qwen3_json",
    "qwen3_xml",
    "xlam",
)
REASONING_PARSERS = (
    "deepseek_r1",
    "glm45",
    "glm47",
    "granite",
    "mistral",
    "openai_gptoss",
    "qwen3",
    "step3",
)
# Older Rankgate names, kept so existing deployments keep their flags.
TOOL_ALIASES = {"qwen25": "hermes", "qwen3_coder_hermes": "hermes"}
REASONING_ALIASES = {"think": "qwen3"}

# Reasoning parsers that vLLM runs on its parser engine (they shape content like the
# engine-based tool formats do).
_ENGINE_REASONING = frozenset({"qwen3", "glm45", "glm47", "mistral"})


def canonical_tool_parser(name: str) -> str | None:
    name = TOOL_ALIASES.get(name, name)
    return name if name in TOOL_PARSERS else None


def canonical_reasoning_parser(name: str) -> str | None:
    name = REASONING_ALIASES.get(name, name)
    return name if name in REASONING_PARSERS else None


def vocabulary(directory: Path) -> Vocabulary:
    """The added tokens of a tokenizer, and its special tokens as transformers lists them
    (the named ones and ``additional_special_tokens``)."""
    tokens: set[str] = set()
    spec = orjson.loads((directory / "tokenizer.json").read_bytes())
    for token in spec.get("added_tokens", ()):
        tokens.add(str(token.get("content", "")))
    model_vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        tokens.update(t for t in model_vocab if t.startswith(("[", "<")))
    special: set[str] = set()
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        config = orjson.loads(path.read_bytes())
        for key, value in config.items():
            if key.endswith("_token"):
                content = _content(value)
                if content:
                    special.add(content)
            elif key in ("additional_special_tokens", "extra_special_tokens"):
                values = value.values() if isinstance(value, dict) else value or ()
                special.update(c for v in values if (c := _content(v)))
    return Vocabulary(frozenset(tokens), frozenset(special))


def _content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _thinking(name: str, kwargs: Mapping[str, Any]) -> bool:
    """The chat template switch a family's parser reads to know whether the model thinks."""
    if name == "qwen3":
        return bool(kwargs.get("enable_thinking", True))
    thinking, enable = kwargs.get("thinking"), kwargs.get("enable_thinking")
    if thinking is None and enable is None:
        return True
    return bool(thinking) or bool(enable)


@functools.cache
def _splitter(
    name: str, thinking: bool, special: frozenset[str]
) -> Callable[[], ReasoningSplitter]:
    if name == "deepseek_r1":
        return reasoning.PrefixThink
    if name == "step3":
        return reasoning.EndThink
    if name == "granite":
        return reasoning.GraniteThought
    if not thinking:
        return reasoning.Plain
    if name == "qwen3":
        config = reasoning.MarkupConfig(
            "<think>",
            "</think>",
            starts_inside=True,
            implicit_ends=("<tool_call>",),
            strip_trailing=False,
            known=tuple(markup_formats.QWEN_SPEC.markers.values()),
        )
    elif name in ("glm45", "glm47"):
        config = reasoning.MarkupConfig(
            "<think>",
            "</think>",
            starts_inside=True,
            implicit_ends=("<tool_call>",),
            reopens=True,
            known=tuple(markup_formats.GLM_SPEC.markers.values()),
        )
    else:  # mistral, with [THINK] in the vocabulary
        config = reasoning.MarkupConfig(
            "[THINK]",
            "[/THINK]",
            starts_inside=False,
            implicit_ends=("[TOOL_CALLS]",),
            reopens=True,
            known=("[TOOL_CALLS]", "[ARGS]", "{"),
        )
    return functools.partial(reasoning.MarkupThink, config, special)


def reasoning_factory(
    name: str | None, vocab: Vocabulary, kwargs: Mapping[str, Any]
) -> Callable[[], ReasoningSplitter] | None:
    if name is None or name == "openai_gptoss":
        return None
    if name == "mistral" and not vocab.has("[THINK]"):
        return None
    return _splitter(name, _thinking(name, kwargs), vocab.special)


@functools.cache
def _syntax(name: str, thinking: bool, reasoning_on: bool, vocab: Vocabulary) -> ToolSyntax:
    special = vocab.special
    if name in ("hermes", "qwen3_json"):
        return json_calls.Hermes()
    if name in ("llama3_json", "llama4_json"):
        return json_calls.LlamaJson()
    if name in ("pythonic", "llama4_pythonic"):
        from rankgate.app.parsers.pythonic import Pythonic

        return Pythonic(llama4=name == "llama4_pythonic")
    if name in ("deepseek_v3", "deepseek_v31"):
        return json_calls.DeepSeek(v31=name == "deepseek_v31")
    if name == "xlam":
        return json_calls.Xlam()
    if name in ("qwen3_coder", "qwen3_xml"):
        return markup_formats.qwen3_coder(special, reasoning_on)
    if name in ("glm45", "glm47"):
        return markup_formats.glm45(special, thinking, reasoning_on)
    if name == "kimi_k2":
        return markup_formats.kimi_k2(special, thinking, reasoning_on)
    if name == "granite":
        return markup_formats.granite(special)
    if name == "mistral":
        if not vocab.has("[ARGS]"):
            return json_calls.MistralJson()
        return markup_formats.mistral_v11(special, vocab.has("[THINK]"), reasoning_on)
    raise KeyError(name)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any] | None
    strict: bool = False


@dataclass(frozen=True, slots=True)
class PlanResult:
    plan: OutputPlan
    # What the engine's output must follow, if anything: a JSON schema, or a structural tag
    # in the model's own call syntax (as vLLM sends for its strict tool calling).
    schema: dict[str, Any] | None = None
    structural_tag: dict[str, Any] | None = None


# Formats whose markers vLLM keeps in the detokenized text (its parser sets
# skip_special_tokens off); the others read the text as the request's setting leaves it.
_KEEPS_SPECIAL = frozenset(
    {
        "hermes",
        "qwen3_json",
        "mistral",
        "qwen3_coder",
        "qwen3_xml",
        "kimi_k2",
        "glm45",
        "glm47",
        "granite",
    }
)


def _call_ids(tool_parser: str, vocab: Vocabulary) -> Callable[[int, str], str]:
    if tool_parser == "mistral":
        return mistral_call_id
    if tool_parser == "xlam":
        return xlam_call_id
    return vllm_call_id


# The plans of most requests (nothing to parse), built once rather than per request.
_NOTHING_TO_PARSE = {
    False: PlanResult(OutputPlan()),
    True: PlanResult(OutputPlan(needs_special_tokens=True)),
}


def plan_for(
    tool_parser: str | None,
    reasoning_parser: str | None,
    vocab: Vocabulary,
    *,
    tools: list[Tool] | None,
    tool_choice: str | None,
    named: str | None,
    parallel_tool_calls: bool | None,
    template_kwargs: Mapping[str, Any],
) -> PlanResult:
    """How to parse one request's output, as vLLM's chat server would for the same request.

    ``tool_choice`` is "none", "auto", "required" or None (named choices pass ``named``).
    """
    splitter = reasoning_factory(reasoning_parser, vocab, template_kwargs)
    single = parallel_tool_calls is False
    choice = "named" if named is not None else (tool_choice or ("auto" if tools else "none"))
    if tool_parser == "openai" or reasoning_parser == "openai_gptoss":
        return _harmony(tool_parser, reasoning_parser, tools, choice, named, single)
    if tool_parser is None:
        if tools and choice in ("named", "required"):
            # vLLM's generic path: the engine is held to a JSON schema, the output read as it.
            return _forced(splitter, tools, choice, named, single, vllm_call_id)
        needs_special = reasoning_parser in _ENGINE_REASONING
        if splitter is None:
            return _NOTHING_TO_PARSE[needs_special]
        return PlanResult(OutputPlan(reasoning=splitter, needs_special_tokens=needs_special))
    thinking = _thinking(tool_parser, template_kwargs)
    syntax = _syntax(tool_parser, thinking, reasoning_parser is not None, vocab)
    ids = _call_ids(tool_parser, vocab)
    schemas = {t.name: t.parameters for t in tools or ()}
    engine_based = syntax.engine and (
        reasoning_parser is None or reasoning_parser in _ENGINE_REASONING
    )
    # As vLLM's parsers set it (and only when its renderer lets them adjust the request).
    calls_possible = bool(tools) and choice != "none"
    keep_special = tool_parser in _KEEPS_SPECIAL and (
        calls_possible
        or (reasoning_parser is not None and tool_parser not in ("hermes", "qwen3_json", "kimi_k2"))
    )
    keep_special = keep_special or reasoning_parser in _ENGINE_REASONING
    if choice == "none":
        if not engine_based:
            return PlanResult(OutputPlan(reasoning=splitter, needs_special_tokens=keep_special))
        context = ToolContext(schemas, suppress=bool(tools), engine_content=True)
        plan = OutputPlan(
            reasoning=splitter,
            tools=syntax,
            context=context,
            discard_calls=True,
            needs_special_tokens=keep_special,
        )
        return PlanResult(plan)
    if choice in ("named", "required") and syntax.json_forcing and tools:
        return _forced(splitter, tools, choice, named, single, vllm_call_id, keep_special)
    schema = None
    if tool_parser == "mistral" and choice in ("named", "required") and tools:
        schema = _mistral_schema(tools, named)
        if isinstance(syntax, json_calls.MistralJson):
            syntax = json_calls.MistralJson(forced=True)
    tag = structural_tag(tool_parser, _tag_tools(tools), choice, named, single)
    plan = OutputPlan(
        reasoning=splitter,
        tools=syntax,
        context=ToolContext(schemas, engine_content=engine_based),
        named=choice == "named",
        required=choice == "required",
        single_call=single,
        call_id=ids,
        needs_special_tokens=keep_special,
    )
    return PlanResult(plan, schema=schema, structural_tag=tag)


def _harmony(
    tool_parser: str | None,
    reasoning_parser: str | None,
    tools: list[Tool] | None,
    choice: str,
    named: str | None,
    single: bool,
) -> PlanResult:
    """gpt-oss's channels: calls are read from messages to functions, held to the structural
    tag vLLM sends when they are asked for."""
    calls = tool_parser == "openai"
    plan = OutputPlan(
        harmony=(reasoning_parser == "openai_gptoss", calls),
        named=choice == "named",
        required=choice == "required",
        single_call=single,
        report_calls=choice != "none" and calls,
        needs_special_tokens=True,
    )
    tag = None
    if calls and choice != "none":
        tag = structural_tag("openai", _tag_tools(tools), choice, named, single)
    return PlanResult(plan, structural_tag=tag)


def _tag_tools(tools: list[Tool] | None) -> list[tuple[str, dict[str, Any] | None, bool]]:
    return [(t.name, t.parameters, t.strict) for t in tools or ()]


def _mistral_schema(tools: list[Tool], named: str | None) -> dict[str, Any]:
    """vLLM's schema for Mistral's tool_choice required/named without its own tokenizer's
    grammar: a bare array of ``{"name", "arguments"}`` (one item for a named function)."""
    chosen = [t for t in tools if named is None or t.name == named]
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    if named is not None:
        schema["maxItems"] = 1
    schema["items"] = {
        "type": "object",
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.name]},
                    "arguments": t.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for t in chosen
        ],
    }
    return schema


def _forced(
    splitter: Callable[[], ReasoningSplitter] | None,
    tools: list[Tool],
    choice: str,
    named: str | None,
    single: bool,
    ids: Callable[[int, str], str],
    keep_special: bool = False,
) -> PlanResult:
    if choice == "named":
        match = next(t for t in tools if t.name == named)
        plan = OutputPlan(
            reasoning=splitter,
            forced_name=named,
            named=True,
            call_id=ids,
            needs_special_tokens=keep_special,
        )
        return PlanResult(plan, _object_schema(match.parameters))
    plan = OutputPlan(
        reasoning=splitter,
        forced_any=True,
        required=True,
        single_call=single,
        call_id=ids,
        needs_special_tokens=keep_special,
    )
    return PlanResult(plan, required_schema(tools, single))


def _object_schema(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}


def required_schema(tools: list[Tool], single: bool = False) -> dict[str, Any]:
    """The JSON schema vLLM holds a ``tool_choice: required`` output to: a non-empty array of
    ``{"name", "parameters"}`` (one item when parallel calls are off), shared ``$defs`` lifted
    to the top."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = dict(tool.parameters) if tool.parameters else None
        if params is not None and "$defs" in params:
            found = params.pop("$defs")
            if not isinstance(found, dict):
                raise ValueError(
                    f"`$defs` in the parameters of tool '{tool.name}' must be an object"
                )
            for key, value in found.items():
                if key in defs and defs[key] != value:
                    raise ValueError(f"Tool definition '{key}' has multiple schemas")
                defs[key] = value
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": _object_schema(params),
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
