"""The engine streams of one request, and the book of every stream the sidecar has open.

OpenAI ``n`` runs as ``n`` engine requests, one per choice, each pinned to the rank its router
chose; a request that does not stream (``PreparedRequest.stream`` false) makes unary
``Generate`` calls instead, one reply per choice rather than one message per token. A
:class:`RequestStreams` launches a request's streams, reads and decodes them, relaunches a
choice its rank refused before anything reached the client, and releases each stream exactly
once, however it ends. Dropping them cancels every stream at once, which makes vLLM abort them,
except a disaggregated decode that has no first token yet: the :class:`StreamBook` reads that
one on in the background (SPEC.md section 8). A disaggregated request is two such requests, on
two sidecars: its unary prefill, then its decode hand-off (``rankgate.sidecar.disagg``).

Every engine stream holds an admission slot on its rank from launch until it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from rankgate.sidecar.admission import Admission, Grant
from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.convert import DeltaDecoder
from rankgate.sidecar.errors import (
    BadEngineResponse,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    KvLeaseExpired,
    SidecarError,
)
from rankgate.sidecar.grpc_call import Call
from rankgate.sidecar.inference_client import GenerateRequest, GenerateResponse
from rankgate.sidecar.lifecycle import Lifecycle, rank_metadata
from rankgate.sidecar.routing.base import Router, RouteTicket
from rankgate.sidecar.types import Delta, DeltaSink, EngineCallTrace, PreparedRequest

log = logging.getLogger(__name__)

# In-flight requests sent without a rank (vLLM's own balancer chooses) are counted here.
UNPINNED_RANK = -1
# A choice refused by its rank before its first byte is tried on this many other ranks.
MAX_RANK_RETRIES = 2


class EngineStream(msgspec.Struct, eq=False):
    """One engine request (one choice, or a relaunch of it) and its bookkeeping."""

    call: Call[GenerateResponse]
    ticket: RouteTicket
    # The rank it was sent to, or UNPINNED_RANK.
    rank_key: int
    request_id: str
    # The gateway request it serves a choice of.
    parent: str
    decoder: DeltaDecoder
    handoff: bool
    # The admission key whose slot this stream holds (None: it holds none).
    slot: int | None
    started: bool = False
    done: bool = False
    # Dropped by ``close()`` under a live consumer.
    preempted: bool = False
    # Ranks that refused this choice already (retries before the first byte).
    avoid: tuple[int, ...] = ()
    # The call's span when the request is traced.
    span: EngineCallTrace | None = None


class StreamBook:
    """Every engine stream one sidecar has open: per-rank counts, ids for ``Control.Abort``,
    the hand-off drains running in the background, and the release that ends each stream."""

    def __init__(
        self, config: SidecarConfig, lifecycle: Lifecycle, router: Router, admission: Admission
    ) -> None:
        self.lifecycle = lifecycle
        self.router = router
        self.admission = admission
        self.handoff_timeout = config.decode_handoff_timeout
        # Open streams per rank key (``UNPINNED_RANK`` for those sent without a rank).
        self.in_flight: dict[int, int] = {}
        self.by_id: dict[str, EngineStream] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Choices relaunched on another rank after a rank-local refusal.
        self.retries = 0

    def release(self, stream: EngineStream) -> None:
        """The stream ended, however it ended: its ticket, slot and counts go back, once
        (``RequestStreams._launch`` counts it in)."""
        if stream.done:
            return
        stream.done = True
        stream.ticket.finished()
        if stream.span is not None:
            stream.span.end()
        if stream.slot is not None:
            self.admission.give(stream.slot)
        remaining = self.in_flight.get(stream.rank_key, 0) - 1
        if remaining > 0:
            self.in_flight[stream.rank_key] = remaining
        else:
            self.in_flight.pop(stream.rank_key, None)
        self.by_id.pop(stream.request_id, None)

    def engine_ids(self, request_id: str) -> list[str]:
        """The engine request ids of every open choice of gateway request ``request_id``."""
        return [stream.request_id for stream in self.by_id.values() if stream.parent == request_id]

    def failure(self, stream: EngineStream, error: SidecarError) -> SidecarError:
        if stream.span is not None:
            stream.span.end(error.message)
        if isinstance(error, (EngineUnavailable, EngineFailure)):
            log.warning("request %s failed: %s", stream.request_id, error.message)
            self.lifecycle.nudge()
        elif isinstance(error, BadEngineResponse):
            log.warning("request %s: bad engine reply: %s", stream.request_id, error.message)
        return error

    def truncated(self, stream: EngineStream) -> EngineFailure:
        self.lifecycle.nudge()
        return EngineFailure(f"the engine ended request {stream.request_id} without finishing it")

    def hand_off(self, stream: EngineStream, read: asyncio.Future[GenerateResponse] | None) -> None:
        """Read a dropped decode hand-off on in the background (see :meth:`_drain`)."""
        self._spawn(self._drain(stream, read))

    async def close(self) -> None:
        """Pre-empt every open stream and stop every drain (shutdown)."""
        for task in list(self._background):
            task.cancel()
        for stream in list(self.by_id.values()):
            stream.preempted = True
            stream.call.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for stream in list(self.by_id.values()):
            self.release(stream)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _drain(
        self, stream: EngineStream, read: asyncio.Future[GenerateResponse] | None
    ) -> None:
        """Keep reading a cancelled decode request until its first token or its end (SPEC.md
        section 8), so the KV transfer it started completes and its blocks are released; drop
        it then, or when ``decode_handoff_timeout`` runs out, or when the gateway shuts down.
        """
        loop = asyncio.get_running_loop()
        timeout = self.handoff_timeout
        deadline = loop.time() + timeout
        try:
            while True:
                if read is None:
                    read = asyncio.ensure_future(anext(stream.call))
                done, _ = await asyncio.wait({read}, timeout=max(deadline - loop.time(), 0.0))
                if not done:
                    log.warning(
                        "decode request %s had no first token %.1f s after its client left; "
                        "dropping it (its KV transfer may be stranded)",
                        stream.request_id,
                        timeout,
                    )
                    break
                response, read = read.result(), None
                output = response.outputs
                if output.token_ids or output.HasField("finish_info"):
                    break
        except (StopAsyncIteration, SidecarError, asyncio.CancelledError):
            pass
        finally:
            if read is not None and not read.done():
                read.cancel()
                read.add_done_callback(_consume_result)
            stream.call.cancel()
            self.release(stream)


class RequestStreams(msgspec.Struct, eq=False):
    """The engine streams of one request: launched, read, relaunched, released and dropped.

    With one stream that is no hand-off (``inline``) the consumer's own task reads it; with
    several, or a hand-off, each read is a task in ``reads``, so the first message of any
    stream is handed on first and a hand-off's pending read can outlive the consumer.
    """

    _book: StreamBook
    _request: PreparedRequest
    _messages: list[GenerateRequest]
    handoff: bool
    # Unary Generate calls, one reply each, rather than streams.
    unary: bool
    inline: bool
    _grant: Grant | None = None
    # Every stream launched for the request, relaunches included.
    opened: list[EngineStream] = msgspec.field(default_factory=list)
    reads: dict[asyncio.Future[GenerateResponse], EngineStream] = msgspec.field(
        default_factory=dict
    )
    # Whether a delta has been handed on: from then on a refusal is the client's error.
    yielded: bool = False
    # A disaggregated decode: the ``time.monotonic()`` until which the prefill engine surely
    # still holds the KV it reads. Past it, the decode is neither sent nor handed off.
    trusted_until: float | None = None

    @property
    def width(self) -> int:
        """The engine streams the request opens (its choices): its admission weight."""
        return len(self._messages)

    def launch(self, grant: Grant) -> None:
        """Launch every choice, each holding its slot through ``grant``.

        Raises KvLeaseExpired for a decode whose prefill's KV may be released by now.
        """
        if self.lease_ended():
            raise KvLeaseExpired(
                f"the decode of {self._request.request_id} could not start before the prefill "
                "engine's KV lease could end"
            )
        self._grant = grant
        request = self._request
        for choice, message in enumerate(self._messages):
            self.opened.append(self._launch(request, choice, message, grant))

    def hand_off_unsent(self) -> None:
        """A disaggregated decode that will not be sent (its client left, or no slot freed in
        time) while the prefill engine holds the prompt's KV for it: vLLM's NIXL connector
        frees that KV only once a decode engine has read it, or when its lease (30 s) expires.

        Hand it off anyway: the decode request cut to one token, outside admission (it holds
        a slot over the limit for the moment it runs), read to its first token and dropped
        like any hand-off. The decode engine reads the KV, and NIXL's notification frees the
        blocks on the prefill side at once. Dropping the request unsent, or before the engine
        has scheduled it, leaves them held for the whole lease (seen on vLLM 0.32).
        """
        book = self._book
        lifecycle = book.lifecycle
        if lifecycle.closed or lifecycle.pool is None:
            return
        request = self._request
        if self.lease_ended():
            # The prefill engine may have freed the KV already: a read now would only pull
            # blocks that may belong to another request by now.
            log.info("not handing off %s: its KV lease may have ended", request.request_id)
            return
        over_limit = book.admission.grant(request.rank, len(self._messages), request.priority)
        for choice, message in enumerate(self._messages):
            release = GenerateRequest()
            release.CopyFrom(message)
            release.stopping.max_new_tokens = 1
            release.stopping.min_new_tokens = 0
            try:
                stream = self._launch(request, choice, release, over_limit)
            except Exception as error:  # the KV then waits out its lease: say so
                log.warning(
                    "could not hand off the KV of %s after its client left: %s",
                    release.request_id,
                    error,
                )
                return
            read = next((task for task, s in self.reads.items() if s is stream), None)
            if read is not None:
                del self.reads[read]
            book.hand_off(stream, read)

    @property
    def request(self) -> PreparedRequest:
        return self._request

    def lease_ended(self) -> bool:
        until = self.trusted_until
        return until is not None and time.monotonic() >= until

    def read(self, stream: EngineStream) -> asyncio.Future[GenerateResponse]:
        """Start reading the next message of ``stream`` into ``reads``."""
        call = stream.call
        awaitable = call.reply() if self.unary else anext(call)
        read = asyncio.ensure_future(awaitable)
        self.reads[read] = stream
        return read

    def accept(self, stream: EngineStream, response: GenerateResponse) -> Delta | None:
        """The delta a streamed message makes for the client, if any."""
        delta = stream.decoder.feed(response)
        if delta is None:
            return None
        if delta.prompt_tokens is not None:
            # A choice's first delta says where it ran (for the access log and metrics).
            delta.rank = None if stream.rank_key == UNPINNED_RANK else stream.rank_key
            delta.cached_tokens = stream.ticket.decision.cached_tokens
            delta.route = stream.ticket.decision.header()
        if not stream.started and delta.token_ids:
            stream.started = True
            stream.ticket.first_token()
        if delta.finish_reason is not None:
            self._book.release(stream)
        self.yielded = True
        return delta

    def pusher(self, stream: EngineStream, sink: DeltaSink) -> Callable[[GenerateResponse], bool]:
        """What ``stream``'s call offers each message to once ``sink`` takes its deltas: a
        message that neither starts nor ends the choice becomes a delta for ``sink`` while it
        is ready; any other is left to the reader, which releases the stream at its end."""
        accept = self.accept
        ready = sink.ready
        put = sink.put

        def push(response: GenerateResponse) -> bool:
            if not stream.started or not ready() or response.outputs.HasField("finish_info"):
                return False
            delta = accept(stream, response)
            if delta is not None:
                put(delta)
            return True

        return push

    def accept_reply(self, stream: EngineStream, response: GenerateResponse) -> Delta:
        """The whole output of a unary call as one delta; a reply without a finish is an
        engine failure, as a stream that ends early is."""
        delta = self.accept(stream, response)
        if delta is None or not stream.done:
            raise self._book.truncated(stream)
        return delta

    def failed(self, stream: EngineStream, error: BaseException) -> EngineStream:
        """The stream that carries the choice on after ``error`` ended a read of ``stream``
        (relaunched on another rank), or the typed error raised.

        A stream that ends early is EngineFailure; a stream dropped by ``close()`` under a live
        consumer is EngineUnavailable; the consumer's own cancellation goes on as it came.
        """
        book = self._book
        failure: SidecarError | None = None
        try:
            if isinstance(error, SidecarError):
                failure = book.failure(stream, error)
                retry = None if self.yielded else self._retry(stream, failure)
                if retry is None:
                    raise failure from None
                # Answered here: its traceback holds the reader's frame, which holds these
                # streams and so the call that keeps the error.
                error.__traceback__ = None
                failure.__traceback__ = None
                return retry
            if isinstance(error, StopAsyncIteration):
                raise book.truncated(stream) from None
            if isinstance(error, asyncio.CancelledError) and stream.preempted:
                task = asyncio.current_task()
                if task is not None and not task.cancelling():
                    raise book.lifecycle.shutdown_error() from None
            raise error
        finally:
            # An error raised here has this frame in its traceback: were its names to keep
            # the error, the two would be a cycle left to the cyclic collector.
            failure = None
            del error

    def drop(self) -> None:
        """Cancel every unfinished stream now; decode hand-offs finish their first token first."""
        book = self._book
        closed = book.lifecycle.closed
        reads = self.reads
        pending = {stream: task for task, stream in reads.items()} if self.handoff else {}
        for task, stream in reads.items():
            if stream.handoff and not stream.started and not stream.done and not closed:
                continue
            if task.done():
                if not task.cancelled():
                    task.exception()
            else:
                task.cancel()
                task.add_done_callback(_consume_result)
        for stream in self.opened:
            if stream.done:
                continue
            if stream.handoff and not stream.started and not closed:
                book.hand_off(stream, pending.get(stream))
                continue
            stream.call.cancel()
            book.release(stream)

    def _launch(
        self,
        request: PreparedRequest,
        choice: int,
        message: GenerateRequest,
        grant: Grant,
    ) -> EngineStream:
        book = self._book
        lifecycle = book.lifecycle
        assert lifecycle.pool is not None
        trace = request.trace
        start = time.time_ns() if trace is not None else 0
        ticket = book.router.route(request, choice, book.admission.full)
        rank = request.rank if request.rank is not None else ticket.decision.rank
        metadata = None
        if rank is not None:
            metadata = lifecycle.rank_metadata.get(rank) or rank_metadata(rank)
        unary = self.unary
        span = None
        if trace is not None:
            decision = ticket.decision
            trace.routed(
                choice,
                rank,
                decision.cached_tokens,
                decision.prompt_tokens,
                decision.policy,
                decision.reason,
                start,
            )
            span = trace.engine_call(choice, rank, "Generate" if unary else "GenerateStream")
            metadata = (*(metadata or ()), *span.metadata)
        call: Call[GenerateResponse]
        try:
            inference = lifecycle.pool.pick().inference
            if unary:
                call = inference.Generate(message, metadata=metadata)
            else:
                call = inference.GenerateStream(message, metadata=metadata)
        except BaseException:
            ticket.finished()
            if span is not None:
                span.end("the call could not be started")
            raise
        finally:
            book.router.sent()
        stream = EngineStream(
            call,
            ticket,
            UNPINNED_RANK if rank is None else rank,
            message.request_id,
            request.request_id,
            DeltaDecoder(choice, request.output.logprobs is not None),
            self.handoff,
            grant.take(rank),
            span=span,
        )
        in_flight = book.in_flight
        in_flight[stream.rank_key] = in_flight.get(stream.rank_key, 0) + 1
        book.by_id[stream.request_id] = stream
        if unary:
            # A unary reply hides when prefill ends. Counting the request as decoding from
            # the start errs by its prefill time; counting it as prefilling until the reply
            # would overstate its load tenfold for the whole of its decode.
            stream.started = True
            ticket.first_token()
        if not self.inline:
            self.read(stream)
        return stream

    def _retry(self, stream: EngineStream, failure: SidecarError) -> EngineStream | None:
        """Relaunch a choice that its rank refused before anything reached the client.

        Only failures local to one rank qualify: RESOURCE_EXHAUSTED or an internal error from
        a rank the router chose (never one the client pinned, never a decode hand-off, never
        an engine that is unavailable as a whole). The next rank is the least loaded one not
        tried yet that has an admission slot free; at most ``MAX_RANK_RETRIES`` times per
        choice. The new rank's slot is taken before the refusing rank's is given back.
        """
        book = self._book
        current = book.lifecycle.current
        if (
            self._request.rank is not None
            or stream.handoff
            or stream.rank_key == UNPINNED_RANK
            or current is None
            or len(stream.avoid) >= MAX_RANK_RETRIES
            or not isinstance(failure, (EngineOverloaded, EngineFailure))
        ):
            return None
        avoid = (*stream.avoid, stream.rank_key)
        full = book.admission.full
        others = [rank for rank in current.info.ranks if rank not in avoid and rank not in full]
        if not others:
            return None
        in_flight = book.in_flight
        target = min(others, key=lambda rank: in_flight.get(rank, 0))
        log.info(
            "request %s: rank %d refused it (%s); retrying on rank %d",
            stream.request_id,
            stream.rank_key,
            failure.message,
            target,
        )
        choice = stream.decoder.index
        assert self._grant is not None
        retry = self._launch(
            msgspec.structs.replace(self._request, rank=target),
            choice,
            self._messages[choice],
            self._grant,
        )
        retry.avoid = avoid
        book.release(stream)
        book.retries += 1
        self.opened.append(retry)
        return retry


def _consume_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
