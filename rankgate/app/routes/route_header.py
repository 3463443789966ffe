"""The ``x-rankgate-route`` response header: where the router sent a request, and why.

The sidecar puts each choice's routing decision on that choice's first delta; the response
carries the decision of the choice that answered first, which is choice 0 unless ``n`` or a
prompt batch fans the request out (then ``;choice=k`` says which one it was). The value was
built once per engine request by the sidecar, so this costs a dict per response.
"""

from __future__ import annotations

from rankgate.sidecar import Delta

ROUTE_HEADER = "x-rankgate-route"


_RAW_NAME = ROUTE_HEADER.encode()


def route_value(first: Delta | None) -> str | None:
    """The header's value for a response whose primed first delta is ``first`` (None: no
    header)."""
    if first is None or first.route is None:
        return None
    if first.index:
        return f"{first.route};choice={first.index}"
    return first.route


def route_headers(first: Delta | None) -> dict[str, str] | None:
    """The header as a mapping (None: no header)."""
    value = route_value(first)
    return None if value is None else {ROUTE_HEADER: value}


def raw_route_headers(first: Delta | None) -> tuple[tuple[bytes, bytes], ...]:
    """The header as ASGI raw headers (none, or one)."""
    value = route_value(first)
    return () if value is None else ((_RAW_NAME, value.encode("latin-1")),)
