"""The hand-over of one request's output from a rank's scheduler to the RPC that streams it."""

from __future__ import annotations

import asyncio

from rankgate.mocker.output import Emitted, Finish
from rankgate.mocker.status import RpcStatus


class Outbox:
    """Hands a request's output from the scheduler to its RPC, merging what piles up.

    Like vLLM's output collector, a reader that falls behind receives everything produced
    since its last read in one go, so a slow client never slows the scheduler down.
    """

    __slots__ = ("_error", "_items", "_waiter", "_whole", "finished")

    def __init__(self) -> None:
        self._items: list[Emitted] = []
        self._waiter: asyncio.Future[None] | None = None
        self._error: RpcStatus | None = None
        self._whole = False
        self.finished = False

    def put(self, item: Emitted) -> None:
        self._items.append(item)
        if item.finish is not Finish.NOT_FINISHED:
            self.finished = True
        elif self._whole:
            return
        self._wake()

    def fail(self, error: RpcStatus) -> None:
        self._error = error
        self.finished = True
        self._wake()

    async def take(self) -> list[Emitted]:
        """Everything pending; raises the engine's error once the engine has failed."""
        while not self._items:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    async def take_all(self) -> list[Emitted]:
        """Everything up to the finished item, for a unary reply: the reader is woken once,
        not once per step."""
        self._whole = True
        items: list[Emitted] = []
        while True:
            items += await self.take()
            if items[-1].finish is not Finish.NOT_FINISHED:
                return items

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
