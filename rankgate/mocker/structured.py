"""Structured output: a text that satisfies the request's constraint, chosen deterministically.

Instead of masking logits step by step, the mock picks a conforming answer up front (a JSON
value for the schema, a string the regex matches, one of the choices) and the sequence emits
its tokens, then EOS, which is what a grammar-constrained model ends up doing. Grammars and
structural tags cannot be honoured this way and are refused with UNIMPLEMENTED.
"""

from __future__ import annotations

import importlib
import json
import random
import re
import string
from typing import Any

import grpc

from rankgate.mocker.status import RpcStatus, invalid_argument

# The stdlib's regex parser (re._parser since 3.11); typeshed does not describe it.
sre_parse: Any = importlib.import_module("re._parser")

_MAX_REPEAT = 3
_WORDS = ("alpha", "delta", "sigma", "omega", "kappa", "theta")


def unsupported(kind: str) -> RpcStatus:
    return RpcStatus(
        grpc.StatusCode.UNIMPLEMENTED,
        f"the mock engine cannot constrain output to a {kind}; use json, regex or choice",
    )


def target_text(kind: str, spec: Any, rng: random.Random) -> str:
    """The answer a constrained model would give; ``spec`` is the oneof's value."""
    if kind == "choice":
        choices: list[str] = list(spec.choices)
        return choices[rng.randrange(len(choices))]
    if kind == "regex":
        return regex_sample(spec, rng)
    if kind == "json":
        return json.dumps(json_sample(json.loads(spec), rng))
    if kind == "json_object":
        return json.dumps({"answer": rng.choice(_WORDS)})
    raise unsupported(kind.replace("_", " "))


def validate(kind: str, spec: Any) -> None:
    """Reject constraints vLLM would reject, with its wording where it has one."""
    if kind == "json":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise invalid_argument(f"invalid json schema: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise invalid_argument("invalid json schema: a schema must be an object")
    elif kind == "regex":
        if not spec:
            raise invalid_argument("regex cannot be an empty string")
        try:
            re.compile(spec)
        except re.error as exc:
            raise invalid_argument(f"invalid regex: {exc}") from exc
    elif kind == "choice":
        if not spec.choices:
            raise invalid_argument("choice must be a non-empty list")
    elif kind == "grammar":
        if not spec.strip():
            raise invalid_argument("grammar cannot be an empty string")
        raise unsupported("grammar")
    elif kind == "structural_tag":
        raise unsupported("structural tag")


def json_sample(schema: Any, rng: random.Random) -> Any:
    if schema is True or schema == {}:
        return rng.choice(_WORDS)
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        options = list(schema["enum"])
        return options[rng.randrange(len(options))]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = list(schema[key])
            return json_sample(options[rng.randrange(len(options))], rng)
    if schema.get("allOf"):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged.update(part)
        return json_sample(merged, rng)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[rng.randrange(len(kind))]
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        props: dict[str, Any] = schema.get("properties") or {}
        required = set(schema.get("required") or props)
        return {name: json_sample(sub, rng) for name, sub in props.items() if name in required}
    if kind == "array":
        count = max(int(schema.get("minItems", 1)), 1)
        count = min(count, int(schema.get("maxItems", count)))
        return [json_sample(schema.get("items", {}), rng) for _ in range(count)]
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind in ("integer", "number"):
        low = int(schema.get("minimum", 0))
        high = int(schema.get("maximum", low + 100))
        return rng.randint(low, max(low, high))
    if "pattern" in schema:
        return regex_sample(schema["pattern"], rng)
    text = rng.choice(_WORDS)
    low = int(schema.get("minLength", 0))
    high = int(schema.get("maxLength", max(low, len(text))))
    text = (text * (low // len(text) + 1))[: max(low, min(len(text), high))]
    return text


def regex_sample(pattern: str, rng: random.Random) -> str:
    return "".join(_emit(sre_parse.parse(pattern), rng))


_CATEGORIES = {
    "CATEGORY_DIGIT": string.digits,
    "CATEGORY_WORD": string.ascii_letters + string.digits + "_",
    "CATEGORY_SPACE": " ",
    "CATEGORY_NOT_DIGIT": string.ascii_letters,
    "CATEGORY_NOT_WORD": "-",
    "CATEGORY_NOT_SPACE": string.ascii_letters,
}
_PRINTABLE = string.ascii_letters + string.digits


def _emit(parsed: Any, rng: random.Random) -> list[str]:
    out: list[str] = []
    for op, arg in parsed:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "NOT_LITERAL":
            out.append(next(c for c in _PRINTABLE if ord(c) != arg))
        elif name == "ANY":
            out.append(rng.choice(_PRINTABLE))
        elif name == "IN":
            out.append(_from_class(arg, rng))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            top = min(high, low + _MAX_REPEAT) if high != sre_parse.MAXREPEAT else low + 2
            for _ in range(rng.randint(low, max(low, top))):
                out.extend(_emit(sub, rng))
        elif name == "SUBPATTERN":
            out.extend(_emit(arg[-1], rng))
        elif name == "BRANCH":
            branches = arg[1]
            out.extend(_emit(branches[rng.randrange(len(branches))], rng))
        elif name == "CATEGORY":
            out.append(rng.choice(_CATEGORIES.get(str(arg), _PRINTABLE)))
        elif name == "ATOMIC_GROUP":
            out.extend(_emit(arg, rng))
    return out


def _from_class(items: Any, rng: random.Random) -> str:
    negate = False
    pool: list[str] = []
    for op, arg in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            pool.append(chr(arg))
        elif name == "RANGE":
            pool.extend(chr(c) for c in range(arg[0], arg[1] + 1))
        elif name == "CATEGORY":
            pool.extend(_CATEGORIES.get(str(arg), _PRINTABLE))
    if negate:
        excluded = set(pool)
        pool = [c for c in _PRINTABLE if c not in excluded]
    return rng.choice(pool) if pool else "x"
