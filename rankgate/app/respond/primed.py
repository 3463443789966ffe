"""First-delta priming, and closing a delta stream whatever its type.

Priming awaits the first delta before the HTTP response starts, so an engine that refuses
the request produces a proper 4xx/5xx status instead of a 200 stream with an error inside.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from rankgate.sidecar import Delta, EngineFailure


class Primed:
    """An async iterator that yields an already-fetched first delta, then the rest."""

    __slots__ = ("_first", "_rest")

    def __init__(self, first: Delta, rest: AsyncIterator[Delta]) -> None:
        self._first: Delta | None = first
        self._rest = rest

    @property
    def first(self) -> Delta | None:
        """The primed delta, until it has been yielded."""
        return self._first

    def __aiter__(self) -> Primed:
        return self

    async def __anext__(self) -> Delta:
        first = self._first
        if first is not None:
            self._first = None
            return first
        return await self._rest.__anext__()

    def unwrap(self) -> tuple[Delta | None, AsyncIterator[Delta]]:
        """The primed delta (if not yielded yet) and the stream after it, for a consumer that
        iterates the stream itself instead of through this wrapper."""
        first, self._first = self._first, None
        return first, self._rest

    async def aclose(self) -> None:
        await close_stream(self._rest)


def unprimed(stream: AsyncIterator[Delta]) -> tuple[Delta | None, AsyncIterator[Delta]]:
    """``stream`` as (a delta fetched already, the rest): a :class:`Primed` stream is unwrapped
    so that each later delta costs one wrapper less."""
    if isinstance(stream, Primed):
        return stream.unwrap()
    return None, stream


async def close_stream(stream: AsyncIterable[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def prime(stream: AsyncIterator[Delta]) -> Primed:
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        raise EngineFailure("the engine ended the request without any output") from None
    except BaseException:
        await close_stream(stream)
        raise
    return Primed(first, stream)
