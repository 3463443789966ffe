"""The whole JSON answer of a generation route, as a response."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.responses import Response

_CONTENT_TYPE = (b"content-type", b"application/json")


class JsonDocument(Response):
    """A 200 with a JSON body, its header list built directly. Starlette's generic
    ``init_headers`` (a header dict encoded name by name, then scanned for the content type
    and length) and its ``MutableHeaders`` view cost more than the rest of the response on
    the route every non-streaming request takes."""

    media_type = "application/json"

    def __init__(self, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [(b"content-length", b"%d" % len(body)), _CONTENT_TYPE, *headers]
