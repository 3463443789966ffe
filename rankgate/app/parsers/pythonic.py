"""Python-call-list tool calls: ``[get_weather(city="Paris"), get_time()]`` (vLLM's
``pythonic``, and ``llama4_pythonic`` with its optional ``<|python_start|>`` wrapper).

The output must start with the list; Python's own parser reads it, and keyword arguments must
be literals (JSON's ``true``/``false``/``null`` spellings allowed).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

from rankgate.app.parsers.text import dumps
from rankgate.app.parsers.types import ContentRule, Extracted, ToolCall, ToolContext

# The shape vLLM requires before parsing: "[" then calls "name(kw=..., ...)" with keyword
# arguments only, "," between calls, "]" to close (anything may follow).
_NAME = r"[a-zA-Z]+\w*"
_KWARG = _NAME + r"=.*"
_OPEN_CALL = _NAME + r"\((?:" + _KWARG + r",\s*)*"
_INNER_CALL = _OPEN_CALL + r"(?:" + _KWARG + r"\s)?\),\s*"
_LAST_CALL = _OPEN_CALL + r"(?:" + _KWARG + r"\s*)?\)\s*"
_CALL_LIST = re.compile(r"\[(?:" + _INNER_CALL + r")*(?:" + _LAST_CALL + r")+\]", re.S)

_JSON_WORDS = {"null": None, "true": True, "false": False}
_START = "<|python_start|>"
_END = "<|python_end|>"


class _NotACall(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, str | int | float):
            return node.value
        raise _NotACall
    if isinstance(node, ast.Dict):
        keys = node.keys
        if not all(isinstance(k, ast.Constant) for k in keys):
            raise _NotACall
        return {k.value: _literal(v) for k, v in zip(keys, node.values, strict=True)}  # type: ignore[union-attr]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_literal(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name) and node.id in _JSON_WORDS:
        return _JSON_WORDS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise _NotACall


def _dotted(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise _NotACall
    parts.append(node.id)
    return ".".join(reversed(parts))


def parse_call_list(text: str) -> list[ToolCall] | None:
    """The calls of a Python call list at the start of ``text``, or None when it is not one."""
    if _CALL_LIST.match(text) is None:
        return None
    try:
        module = ast.parse(text)
        value = getattr(module.body[0], "value", None)
        if not isinstance(value, ast.List) or not all(isinstance(e, ast.Call) for e in value.elts):
            return None
        calls = []
        for call in value.elts:
            assert isinstance(call, ast.Call)
            if not isinstance(call.func, ast.Name | ast.Attribute):
                return None
            args = {kw.arg: _literal(kw.value) for kw in call.keywords}
            calls.append(ToolCall(_dotted(call.func), dumps(args)))
        return calls
    except (SyntaxError, ValueError, IndexError, TypeError, _NotACall, RecursionError):
        return None


@dataclass(frozen=True, slots=True)
class Pythonic:
    llama4: bool = False
    markers: tuple[str, ...] = ()
    content_rule: ContentRule = "none"
    json_forcing: bool = True
    engine: bool = False
    rewrites: tuple[str, ...] = ()

    def holds_all(self, text: str) -> bool | None:
        if text.startswith("["):
            return True
        if self.llama4:
            if text.startswith(_START):
                return True
            if _START.startswith(text):
                return None
        return False if text else None

    def clean(self, text: str) -> str:
        return text

    def extract(self, text: str, ctx: ToolContext) -> Extracted:
        if self.llama4 and text.startswith(_START):
            text = text[len(_START) :].replace(_END, "")
        calls = parse_call_list(text)
        return Extracted(None, calls) if calls else Extracted(text)
