"""The marker machine behind the marker-driven tool-call formats (:mod:`.markup_formats`).

vLLM parses these with one declarative marker machine (its parser engine): markers switch
states, text is content, call name or arguments by state, and the calls are built from what
each call collected. This module implements the same machine; each family's table is data.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rankgate.app.parsers.text import dumps, loads, typed_arguments
from rankgate.app.parsers.types import ContentRule, Extracted, ToolCall, ToolContext

# States.
CONTENT, REASONING, PREAMBLE, NAME, ARGS, BETWEEN = "C", "R", "P", "N", "A", "B"
_TOOL_STATES = frozenset({PREAMBLE, NAME, ARGS, BETWEEN})
# Events a transition may carry.
START, ARG, END, REASONING_END, REASONING_START = "start", "arg", "end", "rend", "rstart"

Table = dict[tuple[str, str], tuple[str, tuple[str, ...]]]


@dataclass(slots=True)
class Slot:
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
        self.slots: list[Slot] = []
        # Each slot's name and arguments as pieces, joined once the run ends (appending to
        # a string would copy all of it each time).
        self.names: list[list[str]] = []
        self.args: list[list[str]] = []
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
        for slot, name_parts, arg_parts in zip(self.slots, self.names, self.args, strict=True):
            slot.name, slot.args = "".join(name_parts), "".join(arg_parts)

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
                self._start()
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
            self.names[-1].append(text)
        elif state == ARGS:
            if self.spec.array_body:
                self._array_text(text)
            elif self.slots:
                self._arg(text)

    def _start(self, args: str = "") -> None:
        self.slots.append(Slot())
        self.names.append([])
        self.args.append([args])
        self.tool_event = True

    def _arg(self, text: str) -> None:
        self.args[-1].append(text)
        self.tool_event = True

    def _end_call(self) -> None:
        self.tool_event = True

    def _array_text(self, text: str) -> None:
        for i, ch in enumerate(text):
            if self.state != ARGS:
                self._text(text[i:])
                return
            if self.in_element:
                self.args[-1].append(ch)
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
                self._start("{")
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
    read_header: Callable[[Slot], None] | None = None
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

    def _call(self, slot: Slot, ctx: ToolContext) -> ToolCall | None:
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
