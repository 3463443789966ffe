"""Marker-driven tool-call formats: Qwen3-Coder XML, GLM-4.5, Kimi K2, Mistral v11+ and Granite.

vLLM parses these with one declarative marker machine (its parser engine): markers switch
states, text is content, call name or arguments by state, and the calls are built from what
each call collected. This module implements the same machine and each family's table, so the
whole-output result matches vLLM's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rankgate.app.respond.parsers.text import dumps, loads, raw_decode, typed_arguments
from rankgate.app.respond.parsers.types import ContentRule, Extracted, ToolCall, ToolContext

# States.
CONTENT, REASONING, PREAMBLE, NAME, ARGS, BETWEEN = "C", "R", "P", "N", "A", "B"
_TOOL_STATES = frozenset({PREAMBLE, NAME, ARGS, BETWEEN})
# Events a transition may carry.
START, ARG, END, REASONING_END, REASONING_START = "start", "arg", "end", "rend", "rstart"

Table = dict[tuple[str, str], tuple[str, tuple[str, ...]]]


@dataclass(slots=True)
class _Slot:
    name: str = ""
    args: str = ""
    id: str = ""
    # Whether vLLM would have announced this call while parsing (its name was accepted).
    announced: bool = False


@dataclass(frozen=True, slots=True)
class MachineSpec:
    """One family's marker table."""

    markers: dict[str, str]  # marker name -> its text
    table: Table
    # Marker names that belong to reasoning only (left as text when no reasoning parser ran).
    reasoning_markers: frozenset[str] = frozenset()
    convert: Callable[[str], str] | None = None
    array_body: bool = False
    strip_content: bool = True
    validate_names: bool = False


def _terminal_list(spec: MachineSpec, drops: frozenset[str]) -> tuple[tuple[str, str], ...]:
    items = [(text, name) for name, text in spec.markers.items()]
    items += [(text, "DROP") for text in drops]
    return tuple(sorted(items, key=lambda item: -len(item[0])))


class _Run:
    """One pass of the machine over a whole output."""

    def __init__(self, spec: MachineSpec, drops: frozenset[str], skip_reasoning: bool) -> None:
        self.spec = spec
        self.terminals = _terminal_list(spec, drops)
        self.firsts = frozenset(text[0] for text, _ in self.terminals)
        self.skip_reasoning = skip_reasoning
        self.state = CONTENT
        self.slots: list[_Slot] = []
        self.content: list[str] = []
        self.later: list[str] = []
        self.tool_event = False
        # Granite's array body.
        self.array_open = False
        self.in_element = False
        self.depth = 0
        self.in_string = False
        self.escape = False

    def run(self, text: str) -> None:
        pos = 0
        size = len(text)
        while pos < size:
            match = self._match(text, pos)
            if match is None:
                nxt = pos + 1
                while nxt < size and text[nxt] not in self.firsts:
                    nxt += 1
                self._text(text[pos:nxt])
                pos = nxt
                continue
            literal, name = match
            pos += len(literal)
            self._marker(name, literal)
        if self.state in _TOOL_STATES:
            if self.slots and (not self.spec.array_body or self.in_element):
                self._end_call()
            self.state = CONTENT

    def _match(self, text: str, pos: int) -> tuple[str, str] | None:
        if text[pos] not in self.firsts:
            return None
        for literal, name in self.terminals:
            if text.startswith(literal, pos):
                return literal, name
        return None

    def _marker(self, name: str, literal: str) -> None:
        step = self.spec.table.get((self.state, name))
        if step is None or (self.skip_reasoning and name in self.spec.reasoning_markers):
            if name != "DROP" or step is not None:
                self._text(literal)
            return
        state, events = step
        self.state = state
        for event in events:
            if event == START:
                self.slots.append(_Slot())
                self.tool_event = True
            elif event == ARG:
                self._arg(literal)
            elif event == END:
                self._end_call()
        if state == ARGS and self.spec.array_body:
            self.array_open = self.in_element = False

    def _text(self, text: str) -> None:
        state = self.state
        if state == CONTENT:
            (self.later if self.tool_event else self.content).append(text)
        elif state == NAME and self.slots:
            self.slots[-1].name += text
        elif state == ARGS:
            if self.spec.array_body:
                self._array_text(text)
            elif self.slots:
                self._arg(text)

    def _arg(self, text: str) -> None:
        slot = self.slots[-1]
        slot.args += text
        self.tool_event = True

    def _end_call(self) -> None:
        self.tool_event = True

    def _array_text(self, text: str) -> None:
        for i, ch in enumerate(text):
            if self.state != ARGS:
                self._text(text[i:])
                return
            if self.in_element:
                self.slots[-1].args += ch
                if self.escape:
                    self.escape = False
                elif self.in_string:
                    if ch == "\\":
                        self.escape = True
                    elif ch == '"':
                        self.in_string = False
                elif ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth = max(0, self.depth - 1)
                    if ch == "}" and self.depth == 0:
                        self.in_element = False
                        self._end_call()
                continue
            if ch in " \t\r\n":
                continue
            if not self.array_open:
                if ch == "[":
                    self.array_open = True
                    continue
                self.state = CONTENT
                self._text(text[i:])
                return
            if ch == ",":
                continue
            if ch == "{":
                self.slots.append(_Slot(args="{"))
                self.tool_event = True
                self.in_element = True
                self.depth, self.in_string, self.escape = 1, False, False
                continue
            self.state = CONTENT
            if ch != "]":
                self._text(text[i:])
                return
            self.array_open = False


_NAME_IN_ARGS = re.compile(r'"name"\s*:\s*"([^"]*)"')


def _args_of(raw: str) -> tuple[str, str]:
    """(name, arguments) from a call body that is itself a JSON object."""
    raw = raw.strip()
    try:
        parsed = loads(raw)
    except ValueError:
        return "", raw
    if not isinstance(parsed, dict):
        return "", raw
    name = parsed.get("name", "")
    for key in ("arguments", "parameters"):
        if key in parsed:
            value = parsed[key]
            return name, value if isinstance(value, str) else dumps(value)
    return name, dumps({k: v for k, v in parsed.items() if k != "name"})


@dataclass(frozen=True)
class MarkupFormat:
    """A family's table plus the few per-family rules vLLM adds around its machine."""

    spec: MachineSpec
    # Markers that open the tool region from content (streaming stops there).
    openers: tuple[str, ...]
    # Text dropped from content by the table itself (a stray reasoning end marker).
    content_drops: tuple[str, ...] = ()
    content_rule: ContentRule = "strip"
    json_forcing: bool = True
    engine: bool = True
    special: frozenset[str] = frozenset()
    # Family hooks.
    read_header: Callable[[_Slot], None] | None = None
    plain_args: Callable[[str], str] | None = None
    empty_name_ok: bool = False
    # No reasoning parser runs first: reasoning markers in the content are plain text.
    skip_reasoning: bool = False
    drops: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        known = set(self.spec.markers.values())
        object.__setattr__(self, "drops", frozenset(self.special - known))

    @property
    def markers(self) -> tuple[str, ...]:
        return self.openers

    def holds_all(self, text: str) -> bool | None:
        return False

    def clean(self, text: str) -> str:
        for drop in (*self.drops, *self.content_drops):
            if drop in text:
                text = text.replace(drop, "")
        return text

    @property
    def rewrites(self) -> tuple[str, ...]:
        return (*self.drops, *self.content_drops)

    def extract(self, text: str, ctx: ToolContext) -> Extracted:
        run = _Run(self.spec, self.drops, skip_reasoning=self.skip_reasoning)
        run.run(text)
        if ctx.suppress:
            return Extracted("".join(run.content + run.later) or None)
        calls: list[ToolCall] = []
        for slot in run.slots:
            call = self._call(slot, ctx)
            if call is not None:
                calls.append(call)
        content = "".join(run.content)
        if not any(slot.announced for slot in run.slots):
            content += "".join(run.later)
        if not content.strip() and run.slots:
            content = ""
        if calls:
            if self.spec.strip_content:
                content = content.strip()
            elif not content.strip():
                content = ""
        return Extracted(content or None, calls)

    def _accept(self, name: str, ctx: ToolContext) -> bool:
        if not name and not self.empty_name_ok:
            return False
        return not (self.spec.validate_names and ctx.schemas and name not in ctx.schemas)

    def _call(self, slot: _Slot, ctx: ToolContext) -> ToolCall | None:
        if self.read_header is not None:
            self.read_header(slot)
        if not slot.name and not slot.args:
            return None
        # What vLLM's streaming pass would have named the call (decides the trailing text).
        early = slot.name or (
            m.group(1) if (m := _NAME_IN_ARGS.search(slot.args)) and not self.empty_name_ok else ""
        )
        if self.spec.validate_names:
            early = early.strip()
        slot.announced = self._accept(early, ctx) and bool(early or self.empty_name_ok)
        if slot.announced and not slot.name:
            # vLLM names the call from its body while streaming, and keeps that name.
            slot.name = early
        name = slot.name.strip()
        raw = slot.args
        if not name and raw.strip() and not self.empty_name_ok:
            name, args = _args_of(raw)
            if not isinstance(name, str):
                return None
        elif raw.strip():
            args = ""
            if self.spec.convert is not None:
                try:
                    args = self.spec.convert(raw)
                except ValueError:
                    args = ""
            if not args:
                args = self.plain_args(raw) if self.plain_args else _args_of(raw)[1]
        else:
            args = "{}"
        if not self._accept(name, ctx):
            return None
        schema = ctx.schemas.get(name) if name else None
        return ToolCall(name, typed_arguments(args, schema), slot.id or None)


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
_QWEN_PARAM = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.S
)


def _trim_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _qwen_args(raw: str) -> str:
    return dumps({m.group(1): _trim_newline(m.group(2)) for m in _QWEN_PARAM.finditer(raw)})


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
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_args(raw: str) -> str:
    return dumps({m.group(1).strip(): m.group(2) for m in _GLM_ARG.finditer(raw)})


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


def kimi_header(slot: _Slot) -> None:
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
