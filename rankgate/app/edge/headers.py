"""Request header lookups on the hot routes.

Starlette's ``request.headers.get`` scans the header list per lookup and raises and catches a
``KeyError`` for every header that is absent, which most of the ones these routes ask for are
(a request id, a pinned rank). One dict per request, built on the first lookup, answers them
all. The first of repeated headers wins, as with Starlette.
"""

from __future__ import annotations

from starlette.requests import Request

_TABLE = "rankgate.headers"


def request_header(request: Request, name: bytes) -> str | None:
    """The value of header ``name`` (lower case, as ASGI spells names), or None."""
    scope = request.scope
    table: dict[bytes, bytes] | None = scope.get(_TABLE)
    if table is None:
        table = scope[_TABLE] = dict(reversed(scope["headers"]))
    value = table.get(name)
    return None if value is None else value.decode("latin-1")
