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

# The shape vLLM requires before parsing, its regex
#   \[(?:CALL\((?:KW,\s*)*(?:KW\s)?\),\s*)*(?:CALL\((?:KW,\s*)*(?:KW\s*)?\)\s*)+\]
# with CALL and the keyword names ``[a-zA-Z]+\w*`` and KW a name, "=" and then anything
# (``.*``, dot-all), matched at the start of the output. Nested unbounded repetition: on a
# failing output it backtracks through every way of splitting it. It is read here in one pass
# instead: since a keyword argument's value may be anything, a call list whose first keyword
# argument starts at some point matches exactly when ")", spaces and "]" follow somewhere after.
_CALL_OPEN = re.compile(r"[a-zA-Z]\w*\(")
_KEYWORD = re.compile(r"[a-zA-Z]\w*=")
_LIST_CLOSE = re.compile(r"\)\s*\]")
_SPACES = re.compile(r"\s*")


def _after_spaces(text: str, pos: int) -> int:
    spaces = _SPACES.match(text, pos)
    return spaces.end() if spaces else pos


def _looks_like_call_list(text: str) -> bool:
    """Whether vLLM's regex (above) matches at the start of ``text``."""
    if not text.startswith("["):
        return False
    pos = 1
    # Calls that end in "," come first; after one that does not, only calls and "]" follow.
    commas = True
    while True:
        call = _CALL_OPEN.match(text, pos)
        if call is None:
            return False
        keyword = _KEYWORD.match(text, call.end())
        if keyword is not None:
            return _LIST_CLOSE.search(text, keyword.end()) is not None
        pos = call.end()
        if not text.startswith(")", pos):
            return False
        pos += 1
        if commas and text.startswith(",", pos):
            pos = _after_spaces(text, pos + 1)
            continue
        commas = False
        pos = _after_spaces(text, pos)
        if text.startswith("]", pos):
            return True


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
    if not _looks_like_call_list(text):
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
