"""What :class:`~rankgate.app.serving.http1.Http1Protocol` reads of a request's head beyond
``httptools``' callbacks, and the refusals its limits raise from inside them.

A limit broken inside a parser callback cannot answer there: the callback raises one of the
exceptions here, ``httptools`` wraps it, and the protocol answers once ``feed_data`` returns.
"""

from __future__ import annotations

import httptools

# The methods a request names most, decoded once.
METHODS = {m: m.decode() for m in (b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS")}


class HeadTooLarge(Exception):
    """A head over ``max_header_bytes`` or ``max_headers``."""


class ProbesOnly(Exception):
    """A request other than a probe on a connection let in past the cap."""


class BadTarget(Exception):
    """A request target the URL parser refuses."""


def split_target(url: bytes) -> tuple[bytes, bytes]:
    """The path and query of a request target that is not a plain path."""
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError as exc:
        raise BadTarget from exc
    return parsed.path or b"/", parsed.query or b""
