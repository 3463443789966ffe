"""The ``text/event-stream`` response: one write per chunk, and the source always closed.

Unlike a generic streaming response it closes the chunk iterator as soon as the client goes
away (a failed write), so the engine streams behind it are dropped at once rather than when
the abandoned generator is garbage-collected.

A :class:`Guarded` stream (what the OpenAI routes send) is run by the response itself: its
failure event, the closing of its engine streams and its ``on_done`` report happen here, so a
chunk passes through no generator layer of its own between the encoder and the socket.
"""

from __future__ import annotations

from asyncio import get_running_loop
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rankgate.app.errors import as_api_error
from rankgate.app.observability.record import Tracked
from rankgate.app.respond.primed import close_stream, unprimed
from rankgate.app.serving.http1_writers import ChunkWriter
from rankgate.sidecar import Delta

DONE = b"data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_END = {"type": "http.response.body", "body": b"", "more_body": False}


def error_event(exc: Exception) -> tuple[int, bytes]:
    """The status a failure maps to, and the SSE error event (and ``[DONE]``) that says so."""
    error = as_api_error(exc)
    return error.status, b"data: " + error.body() + b"\n\n" + DONE


class ChunkEncoder(Protocol):
    def chunk(self, delta: Delta) -> bytes:
        """The bytes ``delta`` adds to the stream (b"" for none)."""

    def tail(self) -> bytes:
        """The stream's last bytes (the usage chunk when asked for, and ``[DONE]``)."""


def encoded_error(encoder: ChunkEncoder, exc: Exception) -> tuple[int, bytes]:
    """A failure as ``encoder``'s stream tells it: its own ``error(exc)`` when it has one
    (the Responses API's ``response.failed``), else the chat-style error event."""
    own = getattr(encoder, "error", None)
    if own is not None:
        result: tuple[int, bytes] = own(exc)
        return result
    return error_event(exc)


class DeltaEvents:
    """SSE chunks encoded from a delta stream: iterable as bytes, and run by
    :class:`EventStreamResponse` without a generator of its own (the encoder is called in
    the response's own loop)."""

    __slots__ = ("deltas", "encoder")

    def __init__(self, encoder: ChunkEncoder, deltas: AsyncIterator[Delta]) -> None:
        self.encoder = encoder
        self.deltas = deltas

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        chunk = self.encoder.chunk
        first, rest = unprimed(self.deltas)
        if first is not None:
            out = chunk(first)
            if out:
                yield out
        async for delta in rest:
            out = chunk(delta)
            if out:
                yield out
        yield self.encoder.tail()


class Guarded:
    """SSE chunks that end in an error event rather than an exception, with the engine
    stream behind them always closed and ``on_done`` told the status they ended with (200, or
    the error's) exactly once, before the response's last byte."""

    __slots__ = ("events", "on_done", "source")

    def __init__(
        self,
        events: AsyncIterable[bytes],
        source: AsyncIterator[Delta],
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        self.events = events
        self.source = source
        self.on_done = on_done

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The same stream for any other consumer, as a plain async iterator."""
        status = 200
        try:
            async for chunk in self.events:
                yield chunk
        except Exception as exc:
            events = self.events
            if isinstance(events, DeltaEvents):
                status, event = encoded_error(events.encoder, exc)
            else:
                status, event = error_event(exc)
            yield event
        finally:
            await self.finish(status)

    async def finish(self, status: int) -> None:
        await close_stream(self.source)
        if self.on_done is not None:
            self.on_done(status)


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self, chunks: AsyncIterable[bytes] | Guarded, headers: Mapping[str, str] | None = None
    ) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({**_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = self.chunks
        if isinstance(chunks, Guarded):
            await self._run(chunks, scope, send)
            return
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send(_END)
        except OSError:
            # The client went away; there is nobody left to tell.
            return
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _run(self, guarded: Guarded, scope: Scope, send: Send) -> None:
        events = guarded.events
        status = 200
        finished = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if isinstance(events, DeltaEvents):
                # In a task of its own, each delta resumes the few frames of the encoding loop
                # rather than every frame of the ASGI stack above this response. Cancelling
                # this task (the client left) cancels that one.
                writer = ChunkWriter.of(scope)
                status = await get_running_loop().create_task(_send_encoded(events, send, writer))
            else:
                status = await _send_chunks(events, send)
            finished = True
            await guarded.finish(status)
            await send(_END)
        except OSError:
            # The client went away; there is nobody left to tell.
            return
        finally:
            if not finished:
                await close_stream(events)
                await guarded.finish(status)


async def _send_chunks(events: AsyncIterable[bytes], send: Send) -> int:
    """Send every chunk; a failure of the chunks becomes the error event. The status."""
    step = aiter(events).__anext__
    while True:
        try:
            chunk = await step()
        except StopAsyncIteration:
            return 200
        except Exception as exc:
            return await _send_error(exc, send)
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


class _DirectSink:
    """The stream's middle deltas, encoded and written from the engine connection's callback
    (a :class:`~rankgate.sidecar.DeltaSink`): the response's task is not woken for them at all.

    The sidecar asks :meth:`ready` right before each :meth:`put`, and nothing between the two
    touches the connection, so the write cannot be refused."""

    __slots__ = ("_chunk", "_note", "_write", "ready")

    def __init__(
        self,
        writer: ChunkWriter,
        chunk: Callable[[Delta], bytes],
        note: Callable[[Delta], None] | None,
    ) -> None:
        self.ready = writer.ready
        self._write = writer.write_ready
        self._chunk = chunk
        self._note = note

    def put(self, delta: Delta) -> None:
        note = self._note
        if note is not None:
            note(delta)
        out = self._chunk(delta)
        if out:
            self._write(out)


async def _send_encoded(events: DeltaEvents, send: Send, writer: ChunkWriter | None = None) -> int:
    """:func:`_send_chunks` for a delta stream, with the encoder called inline.

    ``writer`` (the server's :class:`~rankgate.app.serving.http1_writers.ChunkWriter`, where it
    has one) takes every chunk after the first, which goes through ``send`` so that the layers
    watching the stream know it has begun; a chunk it declines goes through ``send`` too. Once a
    delta has been read past the first chunk, a sidecar stream is sent a :class:`_DirectSink`,
    and its middle deltas no longer pass through this loop."""
    encoder = events.encoder
    chunk = encoder.chunk
    try:
        first, rest = unprimed(events.deltas)
        if isinstance(rest, Tracked):
            rest, note = rest.unwrap()
        else:
            note = None
        step = aiter(rest).__anext__
        out = chunk(first) if first is not None else b""
    except Exception as exc:
        return await _send_error(exc, send, encoder)
    direct = None
    # The stream's asend(), to hand it the sink once a chunk has gone through send and a step
    # of this loop has started the stream (asend() into one not started yet is an error).
    install = None if writer is None else getattr(rest, "asend", None)
    stepped = False
    while True:
        if out and (direct is None or not direct(out)):
            await send({"type": "http.response.body", "body": out, "more_body": True})
            if writer is not None:
                direct = writer.write
        try:
            if install is not None and stepped and writer is not None and direct is not None:
                delta = await install(_DirectSink(writer, chunk, note))
                install = None
            else:
                delta = await step()
                stepped = True
            if note is not None:
                note(delta)
            out = chunk(delta)
        except StopAsyncIteration:
            break
        except Exception as exc:
            return await _send_error(exc, send, encoder)
    try:
        out = encoder.tail()
    except Exception as exc:
        return await _send_error(exc, send, encoder)
    await send({"type": "http.response.body", "body": out, "more_body": True})
    return 200


async def _send_error(exc: Exception, send: Send, encoder: ChunkEncoder | None = None) -> int:
    status, event = error_event(exc) if encoder is None else encoded_error(encoder, exc)
    await send({"type": "http.response.body", "body": event, "more_body": True})
    return status
