"""A request's head, read once: what the OpenAI routes need from its headers and its scope.

Starlette's ``request.headers.get`` scans the header list per lookup and raises and catches a
``KeyError`` for every header that is absent, which most of the ones asked for are (a request
id, a pinned rank). Here one dict, built from the raw ASGI pairs, answers every lookup, and
the first of repeated headers wins, as with Starlette.

A header the gateway refuses is kept as the error to answer with, not raised at once, so that
each refusal comes where the route's order of checks puts it: a bad ``X-Request-Id`` before
anything else, a bad rank pin only once the body has been read and its model found.
"""

from __future__ import annotations

import re

import msgspec
from starlette.types import Scope

from rankgate.app.edge.auth import tenant_of
from rankgate.app.edge.request_id import from_header
from rankgate.app.errors import ApiError, invalid

RANK_HEADER = "x-data-parallel-rank"
_RANK_NAME = RANK_HEADER.encode()
_REQUEST_ID = b"x-request-id"
_CONTENT_TYPE = b"content-type"
_CONTENT_LENGTH = b"content-length"
# ASCII digits only: ``str.isdigit`` also accepts superscripts and other scripts' digits,
# some of which ``int`` refuses ('\xb2') and some of which it reads ('\u0663' is 3).
_RANK_TEXT = re.compile(r"[0-9]{1,10}")
_MAX_RANK = 2**31 - 1


class RequestHead(msgspec.Struct, frozen=True, kw_only=True):
    """A Struct, not a frozen dataclass: one is made per request (see
    :class:`rankgate.app.respond.context.ResponseContext`)."""

    # The client's ``X-Request-Id`` when it is usable, else one made up.
    request_id: str
    client_named: bool = False
    # Why the client's ``X-Request-Id`` is refused.
    id_refused: ApiError | None = None
    content_type: str | None = None
    # ``Content-Length`` when it is a decimal number: a larger body is refused unread.
    declared_length: int | None = None
    # The ``x-data-parallel-rank`` pin, or why it is refused.
    rank: int | None = None
    rank_refused: ApiError | None = None
    # The value of the operator's ``--affinity-header``: the conversation the client names.
    session: str | None = None
    # The API key's digest the request was admitted with (:mod:`rankgate.app.edge.auth`).
    tenant: bytes | None = None
    # Bytes of the body, once it is read: how much work the request is, whichever fields
    # hold it.
    body_size: int = 0

    def pinned_rank(self) -> int | None:
        """The header's rank pin; a 400 when it is not a decimal number."""
        if self.rank_refused is not None:
            raise self.rank_refused
        return self.rank


def read_head(scope: Scope, affinity_header: bytes | None) -> RequestHead:
    """The head of the request ``scope`` describes; ``affinity_header`` (lower case) names the
    header a client names its conversation with, when the operator set one."""
    table: dict[bytes, bytes] = dict(reversed(scope["headers"]))
    raw_id = table.get(_REQUEST_ID)
    given_id = None if raw_id is None else raw_id.decode("latin-1")
    request_id, id_refused = from_header(given_id)
    content_type = table.get(_CONTENT_TYPE)
    length = table.get(_CONTENT_LENGTH)
    raw_rank = table.get(_RANK_NAME)
    rank: int | None = None
    rank_refused: ApiError | None = None
    if raw_rank is not None:
        try:
            rank = rank_from_header(raw_rank.decode("latin-1"))
        except ApiError as exc:
            rank_refused = exc
    session = table.get(affinity_header) if affinity_header else None
    return RequestHead(
        request_id=request_id,
        client_named=given_id is not None and id_refused is None,
        id_refused=id_refused,
        content_type=None if content_type is None else content_type.decode("latin-1"),
        declared_length=int(length) if length is not None and length.isdigit() else None,
        rank=rank,
        rank_refused=rank_refused,
        session=None if session is None else session.decode("latin-1"),
        tenant=tenant_of(scope),
    )


def rank_from_header(value: str) -> int:
    """The header's rank; a 400 for anything but a decimal number."""
    text = value.strip(" \t")
    if _RANK_TEXT.fullmatch(text) is None or int(text) > _MAX_RANK:
        shown = ascii(value) if len(value) <= 32 else ascii(value[:29]) + "..."
        raise invalid(
            f"header '{RANK_HEADER}' must be a non-negative decimal integer, got {shown}",
            RANK_HEADER,
        )
    return int(text)
