"""Graceful shutdown: on SIGTERM stop accepting, let in-flight requests finish, then cut cleanly.

uvicorn already stops accepting and closes idle keep-alive connections; on its own it would
then wait and finally cancel the remaining tasks mid-write, which truncates a stream without
a word. Here the in-flight requests get ``grace`` seconds; then the gateway's own hooks run
first: queued requests are refused with 503 and the engine streams are pre-empted, so a
stream ends with an error event and ``[DONE]`` and a waiting request gets a 503, all before
uvicorn's backstop timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None] | None]
# uvicorn's own deadline, after the gateway's hooks have had their turn.
BACKSTOP_S = 5.0


class Shutdown:
    """The drain state the app shares: readiness reads ``draining``; lifespan adds hooks."""

    def __init__(self, grace: float) -> None:
        if grace < 0:
            raise ValueError("shutdown grace must be >= 0")
        self.grace = grace
        self.draining = False
        self._hooks: list[Hook] = []

    def on_expiry(self, hook: Hook) -> None:
        """Run ``hook`` when the grace period ends (refuse the queue, pre-empt streams)."""
        self._hooks.append(hook)

    async def drain(self) -> None:
        """Mark draining, wait out the grace period, then run the hooks in order."""
        self.draining = True
        await asyncio.sleep(self.grace)
        log.info("shutdown grace of %gs is over; ending the requests still in flight", self.grace)
        for hook in self._hooks:
            try:
                result = hook()
                if result is not None:
                    await result
            except Exception:
                log.exception("a shutdown hook failed")


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the gateway's drain running beside its shutdown."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown) -> None:
        super().__init__(config)
        self._drain = shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.get_running_loop().create_task(self._drain.drain())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()
