"""A client's data-parallel rank pin, from the body field or the header.

vLLM's OpenAI server takes the pin from the ``x-data-parallel-rank`` header; Rankgate also
accepts a ``data_parallel_rank`` body field, for clients that cannot set headers. The header is
read with the request's head (:mod:`rankgate.app.edge.head`); here the two must agree. Whether
the engine serves the rank is checked once, by the sidecar, against the engine served when the
request is sent (its ranks can change while the gateway runs).
"""

from __future__ import annotations

from rankgate.app.edge.head import RANK_HEADER
from rankgate.app.errors import invalid

RANK_FIELD = "data_parallel_rank"


def resolve_rank(body: int | None, header: int | None) -> int | None:
    """The rank to pin (None: the router chooses); a 400 when the two disagree."""
    if body is not None and header is not None and body != header:
        raise invalid(
            f"'{RANK_FIELD}' is {body} but header '{RANK_HEADER}' is {header}; give one rank",
            RANK_FIELD,
        )
    return body if body is not None else header
