"""The ``text/event-stream`` response: one write per chunk, and the source always closed.

Unlike a generic streaming response it closes the chunk iterator as soon as the client goes
away (a failed write), so the engine streams behind it are dropped at once rather than when
the abandoned generator is garbage-collected.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self, chunks: AsyncIterator[bytes], headers: Mapping[str, str] | None = None
    ) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({**_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = self.chunks
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            # The client went away; there is nobody left to tell.
            return
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
