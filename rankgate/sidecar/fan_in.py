"""Several sources read as one, each item handed on as soon as it is ready.

Every fan-in on the generation path (a request's ``n`` choices, a completions batch, the
prefill/decode pipelines of several choices) waits with :class:`FirstDone`, so "wait for the
first of several reads" is written once, and :func:`interleave` is the one place that cancels
the reads still pending and closes every source when a consumer stops early.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Generic, TypeVar

from rankgate.sidecar.types import Delta

T = TypeVar("T")
K = TypeVar("K")


class FirstDone(Generic[T, K]):
    """Iterates ``(future, key)`` over ``pending`` as each future completes, removing it.

    The caller may add futures to ``pending`` while iterating (the next read of a source whose
    read just completed) and may remove some (a source it gave up): iteration ends when none
    is left. Futures still pending when the caller stops iterating are the caller's to cancel.
    """

    __slots__ = ("_done", "_pending")

    def __init__(self, pending: dict[asyncio.Future[T], K]) -> None:
        self._pending = pending
        self._done: list[asyncio.Future[T]] = []

    def __aiter__(self) -> FirstDone[T, K]:
        return self

    async def __anext__(self) -> tuple[asyncio.Future[T], K]:
        pending = self._pending
        while True:
            while self._done:
                future = self._done.pop()
                if future in pending:
                    return future, pending.pop(future)
            if not pending:
                raise StopAsyncIteration
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            self._done = list(done)


async def interleave(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """``(k, item)`` for the items of ``streams[k]``, as they arrive; ends when every stream
    has. The first error of any stream ends them all; closing the generator cancels the reads
    in flight and closes every stream."""
    reads: dict[asyncio.Future[T], int] = {}
    try:
        for k, stream in enumerate(streams):
            reads[asyncio.ensure_future(anext(stream))] = k
        async for read, k in FirstDone(reads):
            try:
                item = read.result()
            except StopAsyncIteration:
                continue
            reads[asyncio.ensure_future(anext(streams[k]))] = k
            yield k, item
    finally:
        for task in reads:
            task.cancel()
        if reads:
            await asyncio.gather(*reads, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


async def merge_batch(
    streams: Sequence[AsyncIterator[Delta]], n: int
) -> AsyncGenerator[Delta, None]:
    """The deltas of a batch's requests, generated one by one, as one stream: request k's
    choice i becomes choice ``k * n + i``."""
    merged = interleave(streams)
    try:
        async for k, delta in merged:
            if k:
                delta.index += k * n
            yield delta
    finally:
        await merged.aclose()
