"""A client's data-parallel rank pin, from the body field or the header.

vLLM's OpenAI server takes the pin from the ``x-data-parallel-rank`` header; Rankgate also
accepts a ``data_parallel_rank`` body field, for clients that cannot set headers. Here the two
are read and must agree; whether the engine serves the rank is checked once, by the sidecar,
against the engine served when the request is sent (its ranks can change while the gateway
runs).
"""

from __future__ import annotations

import re

from rankgate.app.errors import invalid

RANK_FIELD = "data_parallel_rank"
RANK_HEADER = "x-data-parallel-rank"
# ASCII digits only: ``str.isdigit`` also accepts superscripts and other scripts' digits,
# some of which ``int`` refuses ('\xb2') and some of which it reads ('\u0663' is 3).
_RANK_TEXT = re.compile(r"[0-9]{1,10}")
_MAX_RANK = 2**31 - 1


def rank_from_header(value: str | None) -> int | None:
    """The header's rank, or None without one; a 400 for anything but a decimal number."""
    if value is None:
        return None
    text = value.strip(" \t")
    if _RANK_TEXT.fullmatch(text) is None or int(text) > _MAX_RANK:
        shown = ascii(value) if len(value) <= 32 else ascii(value[:29]) + "..."
        raise invalid(
            f"header '{RANK_HEADER}' must be a non-negative decimal integer, got {shown}",
            RANK_HEADER,
        )
    return int(text)


def resolve_rank(body: int | None, header: int | None) -> int | None:
    """The rank to pin (None: the router chooses); a 400 when the two disagree."""
    if body is not None and header is not None and body != header:
        raise invalid(
            f"'{RANK_FIELD}' is {body} but header '{RANK_HEADER}' is {header}; give one rank",
            RANK_FIELD,
        )
    return body if body is not None else header
