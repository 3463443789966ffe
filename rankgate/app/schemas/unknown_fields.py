"""vLLM's policy for request fields it does not know: accepted, ignored and logged.

vLLM's server reads requests with ``extra="allow"``: a field it does not know is logged and
has no effect, and clients rely on that (the OpenAI SDK sends newer fields such as
``prompt_cache_retention`` that vLLM has never heard of). The request schemas forbid unknown
fields, which keeps the common path one strict msgspec decode and gives operators a strict
mode (``--reject-unknown-fields``). Only a body that names a field no schema knows takes the
slow path here: it is decoded generically, the named field is dropped where msgspec found it,
and the body is decoded again, until none is left. Fields Rankgate knows but refuses, because
ignoring them would change the answer, are declared in the schemas and keep their 400.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

log = logging.getLogger("rankgate.requests")
T = TypeVar("T")

# msgspec's words for it: "Object contains unknown field `name` - at `$.messages[0]`".
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]+)`(?: - at `\$([^`]*)`)?")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
# More unknown fields than this in one body is not a client that meant well.
MAX_IGNORED = 64
# Bytes of body decoded again, at most, to drop nested unknown fields one at a time: a large
# body pays for one retry, not for one per field (the decode holds the event loop).
REDECODE_BUDGET = 8 << 20
# Names already logged; a bounded set, so varying names cannot grow it without end.
_LOGGED_LIMIT = 1024
_logged: set[str] = set()


class Unresolvable(Exception):
    """An unknown field this module cannot take out of the body: the strict error stands."""


def unknown_field(error: msgspec.MsgspecError) -> tuple[str, str] | None:
    """The unknown field a decode error names, and the path of the object holding it ("" for
    the body itself), or None for any other error."""
    if not isinstance(error, msgspec.ValidationError):
        return None
    found = _UNKNOWN.fullmatch(str(error))
    if found is None:
        return None
    return found[1], found[2] or ""


def decode_ignoring_unknown(
    body: bytes, decoder: msgspec.json.Decoder[T], first: msgspec.ValidationError
) -> T:
    """``body`` as ``decoder``'s type with every unknown field dropped, each logged once.

    ``first`` is the strict decode's error. Raises it (or the next error that is not about an
    unknown field) when the body cannot be read without them. Each retry decodes the whole
    body again, so the body's own unknown fields all go before the first retry, and nested
    ones one per retry, within :data:`REDECODE_BUDGET` bytes (always one retry)."""
    value = msgspec.json.decode(body)

    def read(value: Any) -> T:
        return decoder.decode(msgspec.json.encode(value))

    attempts = max(1, min(MAX_IGNORED, REDECODE_BUDGET // max(len(body), 1)))
    named = unknown_field(first)
    known = _top_level_fields(decoder.type)
    if named is not None and not named[1] and known is not None and isinstance(value, dict):
        for name in [key for key in value if key not in known]:
            del value[name]
            _log_once(name)
        try:
            return read(value)
        except msgspec.ValidationError as again:
            first = again
            attempts -= 1
    return _without_unknown(value, first, read, attempts)


def convert_ignoring_unknown(
    value: Any, into: type[T], first: msgspec.ValidationError, where: str
) -> T:
    """As :func:`decode_ignoring_unknown`, for ``value`` already decoded (a part of the body
    at ``where`` that is typed only later); ``value`` loses the unknown fields."""
    return _without_unknown(value, first, lambda v: msgspec.convert(v, into), MAX_IGNORED, where)


def _top_level_fields(kind: Any) -> frozenset[str] | None:
    """The JSON names of an untagged Struct's fields; None for any other type."""
    config = getattr(kind, "__struct_config__", None)
    if config is None or config.tag is not None:
        return None
    return frozenset(kind.__struct_encode_fields__)


def _without_unknown(
    value: Any,
    error: msgspec.ValidationError,
    read: Callable[[Any], T],
    attempts: int,
    where: str = "",
) -> T:
    for _ in range(attempts):
        named = unknown_field(error)
        if named is None:
            raise error
        try:
            _drop(value, *named, where)
        except Unresolvable:
            raise error from None
        try:
            return read(value)
        except msgspec.ValidationError as again:
            error = again
    raise error


def _drop(value: Any, name: str, path: str, where: str) -> None:
    steps = list(_STEP.finditer(path))
    if "".join(step[0] for step in steps) != path:
        # A dict value's position ("[...]") names no key to follow.
        raise Unresolvable
    holder = value
    for step in steps:
        key, index = step[1], step[2]
        try:
            holder = holder[key] if key is not None else holder[int(index)]
        except (KeyError, IndexError, TypeError):
            raise Unresolvable from None
    if not isinstance(holder, dict) or name not in holder:
        raise Unresolvable
    del holder[name]
    keys = [step[1] for step in steps if step[1] is not None]
    _log_once(".".join([*filter(None, [where]), *keys, name]))


def _log_once(field: str) -> None:
    if field in _logged or len(_logged) > _LOGGED_LIMIT:
        return
    _logged.add(field)
    if len(_logged) > _LOGGED_LIMIT:
        log.warning("%d unknown request fields logged; no more will be", _LOGGED_LIMIT)
        return
    log.warning("ignored the request field %r, which Rankgate does not know (as vLLM does)", field)
