"""Client liveness on the generation routes: hang-ups and readers that stopped reading.

An ASGI server's ``send`` returns silently once the client is gone, so a stream would keep the
engine generating until ``max_tokens``; ASGI tells only a pending ``receive`` of the disconnect.
The gateway's own protocol (:mod:`rankgate.app.serving.http1`) tells more: it fires the request's
:class:`~rankgate.app.serving.connections.DisconnectNotice` when the connection is lost (under
another server, one ``receive`` is kept waiting in a task of its own instead). Once the request body
has been
read, a client that leaves before the response is complete has the request's task cancelled:
the cancellation
unwinds through the route, which drops the engine streams (vLLM aborts them) within
milliseconds, whether the request is queued for admission, waiting for its first token or
streaming.

A reader that stops reading is cut ``stall_timeout`` after it stopped, the same way, so one
stuck reader cannot hold engine capacity. Its stop is seen in the receive window its TCP
advertises (:class:`~rankgate.app.serving.connections.PeerWindow`): every byte that arrives unread
shrinks it, so a window that has stayed at least two of its units below its widest, and has not
widened since, belongs to a reader that stopped then. Waiting instead for ``send`` to block
would wait for the buffers on both sides to fill, megabytes, which at a stream's few
kilobytes a second takes minutes; a blocked ``send`` still counts where the kernel does not
tell the window. One shared sweeper looks at the streams a few times a second; a stream
costs a clock read per chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from time import monotonic
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rankgate.app.serving.connections import (
    DISCONNECT_NOTICE,
    PEER_WINDOW,
    DisconnectNotice,
    PeerWindow,
)
from rankgate.app.serving.http1_writers import WholeAnswer

log = logging.getLogger(__name__)

# The scope key of the watched cycle that may write a whole answer itself (see ``answer``).
WHOLE_ANSWER = "rankgate.whole_answer"


class _Cycle:
    """One watched request/response."""

    __slots__ = (
        "_receive",
        "_send",
        "armed",
        "complete",
        "cut",
        "deficit",
        "held",
        "holding_since",
        "notice",
        "owner",
        "since",
        "stalled",
        "task",
        "tracked",
        "watcher",
        "whole",
        "widest",
        "window",
    )

    def __init__(
        self,
        owner: ClientWatch,
        task: asyncio.Task[Any],
        receive: Receive,
        send: Send,
        notice: DisconnectNotice | None,
        window: PeerWindow | None = None,
        whole: WholeAnswer | None = None,
    ) -> None:
        self.owner = owner
        self.whole = whole
        self.task = task
        self._receive = receive
        self._send = send
        self.notice = notice
        self.window = window
        # The widest window the client advertised, how far below it the window is now, and
        # since when it has stayed two units or more below without widening (0: it has not).
        self.widest = 0
        self.deficit = 0
        self.held = 0
        self.holding_since = 0.0
        self.armed = False
        self.watcher: asyncio.Task[None] | None = None
        self.complete = False
        self.cut = False
        self.stalled = False
        self.tracked = False
        self.since = 0.0

    async def receive(self) -> Message:
        message = await self._receive()
        if (
            not self.armed
            and message["type"] == "http.request"
            and not message.get("more_body", False)
        ):
            self.armed = True
            if self.notice is not None:
                self.notice.listener = self._left
            else:
                self.watcher = asyncio.get_running_loop().create_task(self._watch())
        return message

    async def send(self, message: Message) -> None:
        if self.tracked and message.get("more_body", False):
            # A chunk amid a stream, the one case per token.
            self.since = monotonic()
            await self._send(message)
            self.since = 0.0
            return
        if message["type"] == "http.response.body":
            if not message.get("more_body", False):
                self.complete = True
            elif not self.tracked:
                self.tracked = True
                self.owner.track(self)
        self.since = monotonic()
        await self._send(message)
        self.since = 0.0

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write a whole answer in one write, as :meth:`send` would in two messages; False
        when it must go through :meth:`send` (see
        :class:`~rankgate.app.serving.http1_writers.WholeAnswer`)."""
        whole = self.whole
        if whole is None or not whole.write(status, headers, body):
            return False
        self.complete = True
        return True

    async def _watch(self) -> None:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._left()

    def _left(self) -> None:
        if not self.complete:
            self.cancel()

    def unread_since(self, now: float) -> float:
        """Since when the client has left what it was sent unread (0: it reads, or the
        kernel does not tell)."""
        window = self.window
        sample = window.sample() if window is not None else None
        if sample is None:
            return 0.0
        size, unit = sample
        if size > self.widest:
            self.widest = size
        deficit = self.widest - size
        if deficit < 2 * unit:
            self.holding_since = 0.0
        elif not self.holding_since or deficit <= self.deficit - unit:
            # Two units unread, or the window widened (a read) but not all the way.
            self.holding_since = now
            self.held = deficit
        self.deficit = deficit
        # A window that stays narrow without narrowing further is a client that reads what
        # arrives (its kernel keeps less room), not one that stopped: more must pile up.
        return self.holding_since if deficit > self.held else 0.0

    def cancel(self) -> None:
        if not self.cut:
            self.cut = True
            self.task.cancel()

    def close(self) -> None:
        if self.notice is not None:
            self.notice.listener = None
        watcher = self.watcher
        if watcher is not None and not watcher.done():
            watcher.cancel()
        self.owner.untrack(self)


class ClientWatch:
    def __init__(self, app: ASGIApp, paths: Iterable[str], stall_timeout: float) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.stall_timeout = stall_timeout
        self._streams: set[_Cycle] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.disconnects = 0
        self.stalls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        # The loop is asked for once: on Python 3.11 every get_running_loop(), the one inside
        # a bare current_task() included, is a getpid() system call.
        loop = self._loop
        task = asyncio.current_task(loop) if loop is not None else None
        if task is None:
            loop = self._loop = asyncio.get_running_loop()
            task = asyncio.current_task(loop)
        assert task is not None
        whole = WholeAnswer.of(scope, send)
        cycle = _Cycle(
            self,
            task,
            receive,
            send,
            scope.get(DISCONNECT_NOTICE),
            scope.get(PEER_WINDOW),
            whole,
        )
        if whole is not None:
            scope[WHOLE_ANSWER] = cycle
        try:
            await self.app(scope, cycle.receive, cycle.send)
        except asyncio.CancelledError:
            if not cycle.cut:
                raise
            task.uncancel()
            if cycle.stalled:
                self.stalls += 1
                log.warning("cut a stream whose client stopped reading for %gs", self.stall_timeout)
            else:
                self.disconnects += 1
        finally:
            cycle.close()
            if whole is not None:
                # The scope would otherwise hold the cycle that holds the scope.
                del scope[WHOLE_ANSWER]

    def track(self, cycle: _Cycle) -> None:
        if not self.stall_timeout:
            return
        self._streams.add(cycle)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def untrack(self, cycle: _Cycle) -> None:
        self._streams.discard(cycle)

    async def _sweep(self) -> None:
        tick = min(1.0, self.stall_timeout / 4)
        try:
            while self._streams:
                await asyncio.sleep(tick)
                now = monotonic()
                limit = now - self.stall_timeout
                stalled = []
                for cycle in self._streams:
                    unread = cycle.unread_since(now)
                    if (cycle.since and cycle.since < limit) or (unread and unread < limit):
                        stalled.append(cycle)
                for cycle in stalled:
                    cycle.stalled = True
                    cycle.cancel()
                    self._streams.discard(cycle)
        finally:
            self._sweeper = None
