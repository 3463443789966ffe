"""Text and JSON helpers shared by the output formats.

Formats parse JSON with the standard library on purpose: vLLM's parsers do, and the language
it accepts (``NaN``, big integers, the last of duplicate keys) decides what counts as a call.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

_DECODER = json.JSONDecoder()
_JSON_WS = " \t\n\r"


def partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``.

    A set lookup per candidate length, so the cost does not grow with the number of tags
    (harmony's vocabulary has over a thousand special tokens)."""
    prefixes, longest = _prefixes(tags)
    for size in range(min(longest, len(text)), 0, -1):
        if text[-size:] in prefixes:
            return size
    return 0


@functools.lru_cache(maxsize=64)
def _prefixes(tags: tuple[str, ...]) -> tuple[frozenset[str], int]:
    found = frozenset(tag[:size] for tag in tags for size in range(1, len(tag)))
    return found, max((len(p) for p in found), default=0)


def first_of(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The earliest occurrence of any of ``tags`` (longest on a tie), or ``(-1, "")``."""
    at, found = -1, ""
    for tag in tags:
        pos = text.find(tag, start)
        if pos >= 0 and (at < 0 or pos < at or (pos == at and len(tag) > len(found))):
            at, found = pos, tag
    return at, found


class TagScan:
    """The tags of ``tags`` in ``text`` in order, as repeated :func:`first_of` calls from a
    position that only moves forward would find them.

    Each tag's search resumes where it stopped (a tag absent from the rest of the text is
    looked for once), so scanning the whole text costs one pass per tag however many tags
    occur, where calling :func:`first_of` at every occurrence rescans to the end each time."""

    __slots__ = ("_next", "_tags", "_text")

    def __init__(self, text: str, tags: tuple[str, ...]) -> None:
        self._text = text
        self._tags = tags
        # Per tag: its next occurrence at or after the last start asked for (-1: none left;
        # -2: not looked for yet).
        self._next = [-2] * len(tags)

    def first(self, start: int) -> tuple[int, str]:
        """The earliest tag at or after ``start`` (longest on a tie), or ``(-1, "")``;
        ``start`` must not decrease between calls."""
        text, nexts = self._text, self._next
        at, found = -1, ""
        for i, tag in enumerate(self._tags):
            pos = nexts[i]
            if pos == -1:
                continue
            if pos < start:
                pos = nexts[i] = text.find(tag, start)
                if pos < 0:
                    continue
            if at < 0 or pos < at or (pos == at and len(tag) > len(found)):
                at, found = pos, tag
        return at, found


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# Deeper JSON is no call: the decoder would run out of stack a little further down, and
# whatever handles the value next (re-encoding, checks) must not.
MAX_DEPTH = 256


def loads(text: str) -> Any:
    """``json.loads``; raises ``ValueError`` on bad input, nesting past ``MAX_DEPTH``
    included, however deep."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    _check_depth(value)
    return value


def raw_decode(text: str, start: int = 0) -> tuple[Any, int]:
    """The first JSON value at ``start`` (no leading whitespace allowed) and where it ends;
    ``ValueError`` as :func:`loads` raises it."""
    try:
        value, end = _DECODER.raw_decode(text, start)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    _check_depth(value)
    return value, end


def _check_depth(value: Any) -> None:
    level: list[Any] = [value]
    for _ in range(MAX_DEPTH):
        level = [
            child
            for item in level
            if isinstance(item, dict | list)
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, dict | list)
        ]
        if not level:
            return
    raise ValueError("JSON nested too deeply")


def finite(value: Any) -> bool:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return True


# Spellings of JSON-schema types that tool authors write, and what they mean.
_TYPE_NAMES = {
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "enum": "string",
    "int": "integer",
    "int32": "integer",
    "int64": "integer",
    "uint": "integer",
    "uint32": "integer",
    "uint64": "integer",
    "long": "integer",
    "short": "integer",
    "unsigned": "integer",
    "float": "number",
    "float32": "number",
    "float64": "number",
    "double": "number",
    "bool": "boolean",
    "dict": "object",
    "arr": "array",
    "list": "array",
    "sequence": "array",
}
_ENUM_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)
_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema: Any) -> set[str]:
    """Every type a JSON schema allows (``type``, ``enum`` values, ``anyOf``/``oneOf``/
    ``allOf``), ``{"string"}`` when it says nothing."""
    if not isinstance(schema, dict):
        return {"string"}
    found: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        found.add(kind)
    elif isinstance(kind, list):
        found.update(k for k in kind if isinstance(k, str))
    values = schema.get("enum")
    if isinstance(values, list):
        for value in values:
            if value is None:
                found.add("null")
                continue
            for cls, name in _ENUM_TYPES:
                if isinstance(value, cls):
                    found.add(name)
                    break
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list):
            for option in options:
                found |= schema_types(option)
    return found or {"string"}


def coerce_text(value: str, types: set[str]) -> Any:
    """A model's raw text for a parameter as the first type of the schema it reads as."""
    wanted = {_TYPE_NAMES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _TYPE_ORDER:
        if kind not in wanted:
            continue
        if kind == "string":
            return value
        if kind == "null":
            if value.lower() == "null":
                return None
        elif kind == "integer":
            try:
                return int(value)
            except ValueError:
                pass
        elif kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        elif kind == "boolean":
            word = value.lower().strip()
            if word in ("true", "1"):
                return True
            if word in ("false", "0"):
                return False
        else:
            try:
                parsed = loads(value)
            except ValueError:
                continue
            if finite(parsed):
                return parsed
    try:
        parsed = loads(value)
    except ValueError:
        return value
    return parsed if finite(parsed) else value


def _coerce(value: Any, schema: dict[str, Any]) -> tuple[Any, bool]:
    if isinstance(value, str):
        coerced = coerce_text(value, schema_types(schema))
        return coerced, coerced is not value
    if isinstance(value, dict):
        nested = schema.get("properties")
        if isinstance(nested, dict):
            return value, coerce_properties(value, nested)
        return value, False
    if isinstance(value, list):
        items = schema.get("items")
        changed = False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                coerced, moved = _coerce(item, items)
                if moved:
                    value[i] = coerced
                    changed = True
        return value, changed
    coerced = coerce_text(dumps(value), schema_types(schema))
    if type(coerced) is not type(value) or coerced != value:
        return coerced, True
    return value, False


def coerce_properties(args: dict[str, Any], properties: dict[str, Any]) -> bool:
    """Give each argument the type its schema names, in place; whether anything changed."""
    changed = False
    for key, value in args.items():
        prop = properties.get(key)
        if not isinstance(prop, dict):
            continue
        coerced, moved = _coerce(value, prop)
        if moved:
            args[key] = coerced
            changed = True
    return changed


def typed_arguments(arguments: str, schema: dict[str, object] | None) -> str:
    """JSON ``arguments`` with string values retyped per the tool's schema (XML-style formats
    carry every value as text)."""
    properties = (schema or {}).get("properties")
    if not isinstance(properties, dict) or not properties:
        return arguments
    try:
        args = loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(args, dict):
        return arguments
    return dumps(args) if coerce_properties(args, properties) else arguments
