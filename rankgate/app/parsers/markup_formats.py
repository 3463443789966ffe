"""Marker-driven tool-call formats: Qwen3-Coder XML, GLM-4.5, Kimi K2, Mistral v11+ and Granite.

Each family is a table for the marker machine of :mod:`.markup` (the one vLLM's parser engine
runs), with the argument decoding that family needs, so the whole-output result matches vLLM's.
"""

from __future__ import annotations

import re

from rankgate.app.parsers.markup import (
    ARG,
    ARGS,
    BETWEEN,
    CONTENT,
    END,
    NAME,
    PREAMBLE,
    REASONING,
    REASONING_END,
    REASONING_START,
    START,
    MachineSpec,
    MarkupFormat,
    Slot,
    Table,
)
from rankgate.app.parsers.text import dumps, raw_decode

# Qwen3-Coder: <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>
_QWEN_MARKERS = {
    "THINK_START": "<think>",
    "THINK_END": "</think>",
    "TOOL_START": "<tool_call>",
    "TOOL_END": "</tool_call>",
    "FUNC_PREFIX": "<function=",
    "FUNC_END": "</function>",
    "PARAM_START": "<parameter=",
    "PARAM_END": "</parameter>",
    "CLOSE_ANGLE": ">",
}
_QWEN_TABLE: Table = {
    (REASONING, "THINK_START"): (REASONING, ()),
    (REASONING, "THINK_END"): (CONTENT, (REASONING_END,)),
    (CONTENT, "THINK_END"): (CONTENT, ()),
    (REASONING, "TOOL_START"): (PREAMBLE, (REASONING_END, START)),
    (CONTENT, "TOOL_START"): (PREAMBLE, (REASONING_END, START)),
    (CONTENT, "FUNC_PREFIX"): (NAME, (START,)),
    (PREAMBLE, "TOOL_END"): (CONTENT, (END,)),
    (PREAMBLE, "FUNC_PREFIX"): (NAME, ()),
    (NAME, "CLOSE_ANGLE"): (ARGS, ()),
    (NAME, "FUNC_END"): (BETWEEN, (END,)),
    (ARGS, "FUNC_END"): (BETWEEN, (END,)),
    (ARGS, "PARAM_START"): (ARGS, (ARG,)),
    (ARGS, "PARAM_END"): (ARGS, (ARG,)),
    (BETWEEN, "TOOL_END"): (CONTENT, ()),
    (BETWEEN, "TOOL_START"): (PREAMBLE, (START,)),
    (BETWEEN, "FUNC_PREFIX"): (NAME, (START,)),
}
# A parameter's opener (with the spaces after "=") and the tag that ends its value: its closer,
# or the next parameter's opener.
_QWEN_OPEN = re.compile(r"<\s*parameter\s*=\s*")
_QWEN_VALUE_END = re.compile(r"<\s*(?:(/)\s*parameter\s*>|parameter\s*=)")


def _qwen_params(raw: str) -> dict[str, str]:
    r"""What ``finditer`` of vLLM's ``<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|
    (?=<\s*parameter\s*=))`` (dot-all) reads, in one pass: the key runs to the first ">", the
    value to the first closer or next opener. The regex retries every opener that has no ">"
    or no end after it, and its ``\s*`` and ``[^>]*`` split a run of spaces every way first."""
    params: dict[str, str] = {}
    pos = 0
    while (opener := _QWEN_OPEN.search(raw, pos)) is not None:
        close = raw.find(">", opener.end())
        if close < 0:
            break
        end = _QWEN_VALUE_END.search(raw, close + 1)
        if end is None:
            break
        params[raw[opener.end() : close]] = _trim_newline(raw[close + 1 : end.start()])
        # A closer is part of the match; a next opener only ends the value.
        pos = end.end() if end.group(1) else end.start()
    return params


def _trim_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _qwen_args(raw: str) -> str:
    return dumps(_qwen_params(raw))


QWEN_SPEC = MachineSpec(
    markers=_QWEN_MARKERS,
    table=_QWEN_TABLE,
    reasoning_markers=frozenset({"THINK_START", "THINK_END"}),
    convert=_qwen_args,
)

# GLM-4.5/4.7: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>
_GLM_ARG_TAGS = ("ARG_KEY_START", "ARG_KEY_END", "ARG_VALUE_START", "ARG_VALUE_END")
_GLM_TABLE: Table = {
    (CONTENT, "THINK_START"): (REASONING, (REASONING_START,)),
    (REASONING, "THINK_END"): (CONTENT, (REASONING_END,)),
    (CONTENT, "THINK_END"): (CONTENT, ()),
    (REASONING, "THINK_START"): (REASONING, ()),
    (REASONING, "TOOL_START"): (NAME, (REASONING_END, START)),
    (CONTENT, "TOOL_START"): (NAME, (START,)),
    (NAME, "ARG_KEY_START"): (ARGS, (ARG,)),
    (NAME, "TOOL_END"): (CONTENT, (END,)),
    (ARGS, "TOOL_END"): (CONTENT, (END,)),
    **{(ARGS, tag): (ARGS, (ARG,)) for tag in _GLM_ARG_TAGS},
}
_GLM_VALUE_OPEN = re.compile(r"\s*<arg_value>")


def _glm_args(raw: str) -> str:
    r"""What ``finditer`` of vLLM's ``<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>``
    (dot-all) reads, in one pass: a key ends at the first ``</arg_key>`` that a value opener
    follows, the value at the next ``</arg_value>``. The regex rescans the rest of the output
    from every key opener without such an end."""
    args: dict[str, str] = {}
    pos = 0
    while (key_at := raw.find("<arg_key>", pos)) >= 0:
        key_end = raw.find("</arg_key>", key_at + len("<arg_key>"))
        value = None
        while key_end >= 0:
            value = _GLM_VALUE_OPEN.match(raw, key_end + len("</arg_key>"))
            if value is not None:
                break
            key_end = raw.find("</arg_key>", key_end + 1)
        if value is None:
            break
        value_end = raw.find("</arg_value>", value.end())
        if value_end < 0:
            break
        args[raw[key_at + len("<arg_key>") : key_end].strip()] = raw[value.end() : value_end]
        pos = value_end + len("</arg_value>")
    return dumps(args)


GLM_SPEC = MachineSpec(
    markers={
        "THINK_START": "<think>",
        "THINK_END": "</think>",
        "TOOL_START": "<tool_call>",
        "TOOL_END": "</tool_call>",
        "ARG_KEY_START": "<arg_key>",
        "ARG_KEY_END": "</arg_key>",
        "ARG_VALUE_START": "<arg_value>",
        "ARG_VALUE_END": "</arg_value>",
    },
    table=_GLM_TABLE,
    reasoning_markers=frozenset({"THINK_START", "THINK_END"}),
    convert=_glm_args,
    validate_names=True,
)

# Kimi K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
#          <|tool_call_argument_begin|>{json}<|tool_call_end|><|tool_calls_section_end|>
KIMI_SPEC = MachineSpec(
    markers={
        "THINK_START": "<think>",
        "THINK_END": "</think>",
        "SECTION_START": "<|tool_calls_section_begin|>",
        "SECTION_END": "<|tool_calls_section_end|>",
        "TOOL_START": "<|tool_call_begin|>",
        "TOOL_END": "<|tool_call_end|>",
        "ARG_START": "<|tool_call_argument_begin|>",
    },
    table={
        (REASONING, "THINK_START"): (REASONING, ()),
        (REASONING, "THINK_END"): (CONTENT, (REASONING_END,)),
        (CONTENT, "THINK_END"): (CONTENT, ()),
        (REASONING, "SECTION_START"): (PREAMBLE, (REASONING_END,)),
        (CONTENT, "SECTION_START"): (PREAMBLE, ()),
        (PREAMBLE, "TOOL_START"): (NAME, (START,)),
        (NAME, "ARG_START"): (ARGS, ()),
        (ARGS, "TOOL_END"): (BETWEEN, (END,)),
        (ARGS, "SECTION_END"): (PREAMBLE, (END,)),
        (BETWEEN, "TOOL_START"): (NAME, (START,)),
        (PREAMBLE, "SECTION_END"): (PREAMBLE, ()),
        (BETWEEN, "SECTION_END"): (PREAMBLE, ()),
    },
    reasoning_markers=frozenset({"THINK_START", "THINK_END"}),
    strip_content=False,
)
_KIMI_ID = re.compile(r".+:\d+")


def kimi_header(slot: Slot) -> None:
    """Kimi's call header ``functions.NAME:IDX`` is the call's id; the name is inside it.

    A header that does not read so names nothing once arguments came, and is kept as the name
    of a call cut off before them (as vLLM ends it)."""
    if slot.id:
        return
    match = _KIMI_ID.match(slot.name.strip())
    if match is None:
        if slot.args:
            slot.name = ""
        return
    slot.id = match.group(0).strip()
    slot.name = slot.id.split(":")[0].removeprefix("functions.")


def _stripped_or_empty(raw: str) -> str:
    return raw.strip() or "{}"


# Mistral v11+: [TOOL_CALLS]NAME[ARGS]{json} (or NAME{json}), one marker per call.
def mistral_spec(think: bool) -> MachineSpec:
    markers = {"TOOL_CALLS": "[TOOL_CALLS]", "ARGS": "[ARGS]", "OPEN_BRACE": "{"}
    table: Table = {
        (CONTENT, "TOOL_CALLS"): (NAME, (REASONING_END, START) if think else (START,)),
        (NAME, "ARGS"): (ARGS, ()),
        (NAME, "OPEN_BRACE"): (ARGS, (ARG,)),
        (ARGS, "TOOL_CALLS"): (NAME, (END, START)),
    }
    if think:
        markers |= {"THINK_START": "[THINK]", "THINK_END": "[/THINK]"}
        table |= {
            (CONTENT, "THINK_START"): (REASONING, ()),
            (REASONING, "THINK_START"): (REASONING, ()),
            (REASONING, "THINK_END"): (CONTENT, (REASONING_END,)),
            (CONTENT, "THINK_END"): (CONTENT, ()),
            (REASONING, "TOOL_CALLS"): (NAME, (REASONING_END, START)),
        }
    return MachineSpec(
        markers=markers,
        table=table,
        reasoning_markers=frozenset({"THINK_START", "THINK_END"}) if think else frozenset(),
    )


def first_json_value(raw: str) -> str:
    """The first JSON value of a call body; text the model wrote after it is dropped."""
    stripped = raw.strip()
    if not stripped:
        return "{}"
    try:
        _, end = raw_decode(stripped)
    except ValueError:
        return stripped
    return stripped[:end]


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON object opening at ``start`` ends (exclusive), None if it does not."""
    depth, in_string, escape = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if escape:
            escape = False
        elif in_string:
            if ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def member_object(raw: str, key: str) -> str | None:
    """The text of the object-valued top-level member ``key`` of a (maybe cut-off) JSON object,
    as written; None when it has not started. Raises ValueError if the value is no object."""
    depth, in_string, escape, start, last = 0, False, False, -1, None
    for i, ch in enumerate(raw):
        if escape:
            escape = False
            continue
        if in_string:
            if ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                if depth == 1:
                    last = raw[start + 1 : i]
            continue
        if ch == '"':
            in_string, start = True, i
        elif ch == ":" and depth == 1 and last == key:
            at = i + 1
            while at < len(raw) and raw[at] in " \t\n\r":
                at += 1
            if at >= len(raw):
                return None
            if raw[at] != "{":
                raise ValueError(f"member {key!r} is not an object")
            end = _object_end(raw, at)
            return raw[at:] if end is None else raw[at:end]
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return None


def _granite_args(raw: str) -> str:
    return member_object(raw, "arguments") or "{}"


# Granite 3.x: <|tool_call|>[{"name": ..., "arguments": {...}}, ...] (or <tool_call>[...]).
GRANITE_SPEC = MachineSpec(
    markers={"TOOL_TOKEN": "<|tool_call|>", "TOOL_STRING": "<tool_call>"},
    table={
        (CONTENT, "TOOL_TOKEN"): (ARGS, ()),
        (CONTENT, "TOOL_STRING"): (ARGS, ()),
    },
    convert=_granite_args,
    array_body=True,
)


def _without_reasoning(spec: MachineSpec) -> MachineSpec:
    """The family's table when its thinking switch is off: reasoning markers are plain text."""
    gone = spec.reasoning_markers
    return MachineSpec(
        markers={k: v for k, v in spec.markers.items() if k not in gone},
        table={key: step for key, step in spec.table.items() if key[1] not in gone},
        convert=spec.convert,
        array_body=spec.array_body,
        strip_content=spec.strip_content,
        validate_names=spec.validate_names,
    )


def qwen3_coder(special: frozenset[str], reasoning: bool) -> MarkupFormat:
    return MarkupFormat(
        QWEN_SPEC,
        openers=("<tool_call>", "<function="),
        content_drops=("</think>",) if reasoning else (),
        json_forcing=False,
        special=special,
        skip_reasoning=not reasoning,
    )


def glm45(special: frozenset[str], thinking: bool, reasoning: bool) -> MarkupFormat:
    think = thinking and reasoning
    return MarkupFormat(
        GLM_SPEC if thinking else _without_reasoning(GLM_SPEC),
        openers=("<tool_call>", "<think>") if think else ("<tool_call>",),
        content_drops=("</think>",) if think else (),
        json_forcing=False,
        special=special,
        skip_reasoning=not reasoning,
    )


def kimi_k2(special: frozenset[str], thinking: bool, reasoning: bool) -> MarkupFormat:
    return MarkupFormat(
        KIMI_SPEC if thinking else _without_reasoning(KIMI_SPEC),
        openers=("<|tool_calls_section_begin|>",),
        content_drops=("</think>",) if thinking and reasoning else (),
        content_rule="keep",
        json_forcing=False,
        special=special,
        read_header=kimi_header,
        plain_args=_stripped_or_empty,
        skip_reasoning=not reasoning,
    )


def mistral_v11(special: frozenset[str], think: bool, reasoning: bool) -> MarkupFormat:
    active = think and reasoning
    return MarkupFormat(
        mistral_spec(think),
        openers=("[TOOL_CALLS]", "[THINK]") if active else ("[TOOL_CALLS]",),
        content_drops=("[/THINK]",) if active else (),
        json_forcing=False,
        special=special,
        plain_args=first_json_value,
        empty_name_ok=True,
        skip_reasoning=not reasoning,
    )


def granite(special: frozenset[str]) -> MarkupFormat:
    return MarkupFormat(
        GRANITE_SPEC,
        openers=("<|tool_call|>", "<tool_call>"),
        special=special,
    )
