"""The sidecar facade: what the app sees of one vLLM frontend.

Its lifecycle (start, health watch, re-discovery) is :mod:`rankgate.sidecar.lifecycle`; the engine
streams of each request are :mod:`rankgate.sidecar.streams`; admission per rank is
:mod:`rankgate.sidecar.admission`. Here they meet: ``generate`` admits a request, launches its
streams and hands their deltas on as they arrive; closing the generator (or cancelling its consumer)
drops the request's streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

import grpc

from rankgate.sidecar.admission import Admission
from rankgate.sidecar.config import CONTROL_RPC_TIMEOUT_S, SidecarConfig
from rankgate.sidecar.convert import is_decode_handoff
from rankgate.sidecar.fan_in import FirstDone
from rankgate.sidecar.inference_client import GenerateResponse
from rankgate.sidecar.lifecycle import Lifecycle
from rankgate.sidecar.loras import LoraNames
from rankgate.sidecar.routing.base import PrefillCost, Router
from rankgate.sidecar.status import error_from_rpc
from rankgate.sidecar.streams import RequestStreams, StreamBook
from rankgate.sidecar.types import Delta, DeltaSink, EngineInfo, PreparedRequest
from rankgate.wire.proto.vllm import control_pb2


class Sidecar:
    def __init__(
        self, config: SidecarConfig, router: Router, admission: Admission | None = None
    ) -> None:
        self.admission = admission or Admission()
        self._lifecycle = Lifecycle(config, router, self.admission)
        self._book = StreamBook(config, self._lifecycle, router, self.admission)
        self._loras = LoraNames(self._lifecycle)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Wait for vLLM, discover and validate it, configure and start the router, then watch.

        Raises DiscoveryError for an engine Rankgate must not serve and EngineUnavailable when
        the engine is not ready before ``startup_timeout``.
        """
        await self._lifecycle.start()

    async def close(self) -> None:
        """Stop watching, pre-empt in-flight streams, stop the router and close the channels."""
        lifecycle = self._lifecycle
        if lifecycle.closed:
            return
        lifecycle.begin_close()
        self.admission.close(lifecycle.shutdown_error())
        await lifecycle.stop_watching()
        await self._book.close()
        self._loras.close()
        await lifecycle.close()

    @property
    def ready(self) -> bool:
        return self._lifecycle.ready

    @property
    def engine_model(self) -> str:
        """The name vLLM itself serves the model under (``served_model_name`` may rename it
        towards clients); "" before discovery."""
        current = self._lifecycle.current
        return current.wire_model if current is not None else ""

    @property
    def info(self) -> EngineInfo:
        lifecycle = self._lifecycle
        current = lifecycle.current
        if not lifecycle.ready or current is None:
            raise lifecycle.unavailable()
        return current.info

    def prefill_cost(self, request: PreparedRequest) -> PrefillCost:
        """What prefilling ``request`` on this engine would cost now, on its best rank (the
        router's view; nothing is routed). Raises EngineUnavailable before discovery."""
        return self._book.router.prefill_cost(request)

    def in_flight(self) -> dict[int, int]:
        """Engine requests this gateway has open, per pinned rank (``UNPINNED_RANK`` for those
        sent without a rank). Every served rank is listed, idle ones with 0."""
        current = self._lifecycle.current
        counts = dict.fromkeys(current.info.ranks, 0) if current else {}
        counts.update(self._book.in_flight)
        return counts

    @property
    def retries(self) -> int:
        """Choices relaunched on another rank after a rank-local refusal."""
        return self._book.retries

    # ---------------------------------------------------------------- generation

    async def generate(
        self,
        request: PreparedRequest,
        *,
        decode_handoff: bool = False,
        trusted_until: float | None = None,
    ) -> AsyncGenerator[Delta, DeltaSink | None]:
        """Stream the deltas of every choice of ``request``, interleaved as they arrive.

        Raises the typed errors of ``rankgate.sidecar.errors``; nothing is sent to the engine when
        the request fails validation or admission (GatewayOverloaded when no slot frees in time).
        Each choice's stream holds a slot on the rank it runs on. Closing the iterator (or
        cancelling its consumer) drops all of the request's streams at once, except a
        disaggregated decode (``decode_handoff``, or params marked ``do_remote_prefill``) that
        has not produced its first token yet: that one is read on in the background, at most
        ``decode_handoff_timeout`` seconds. Such a decode is not sent once ``trusted_until``
        (``time.monotonic()``) has passed, when the KV it reads may be gone (KvLeaseExpired).

        A consumer of a streamed request may send a :class:`DeltaSink` in (``asend``): the
        choice's middle deltas then go to it from the engine connection's callback, and the
        consumer's task wakes only for the last delta, a failure, or while the sink is not
        ready. A request of several streams ignores it.
        """
        streams = self._streams(request, decode_handoff or is_decode_handoff(request), alone=True)
        streams.trusted_until = trusted_until
        if not streams.inline:
            async with aclosing(self._fan_in([streams], 0)) as fanned:
                async for item in fanned:
                    yield item
            return
        # The common case reads in the consumer's own task: no extra task per message, and
        # the call's own iterator (or its one reply), the cheapest way to read it.
        try:
            await self._launch([streams])
            unary = streams.unary
            accept = streams.accept_reply if unary else streams.accept
            stream = streams.opened[0]
            call = stream.call
            while True:
                try:
                    response = await (call.reply() if unary else anext(call))
                except BaseException as error:
                    # A relaunch comes only before the first delta, so before any sink.
                    stream = streams.failed(stream, error)
                    call = stream.call
                    continue
                delta = accept(stream, response)
                if delta is not None:
                    sink = yield delta
                    if stream.done:
                        return
                    if sink is not None and not unary:
                        call.push = streams.pusher(stream, sink)
        finally:
            # A pusher holds its stream, which holds the call that holds the pusher.
            for opened in streams.opened:
                opened.call.push = None
            streams.drop()

    async def generate_batch(
        self, requests: Sequence[PreparedRequest], n: int
    ) -> AsyncGenerator[Delta, None]:
        """The deltas of every request of a batch (a completions request with several
        prompts), request k's choice i as choice ``k * n + i``, interleaved as they arrive.

        The streams of all of them are admitted as one: every slot at once, or
        GatewayOverloaded before anything is sent. Admitting each request on its own would
        let a large batch run in part and then be refused, or hold slots while it waits for
        more. Closing the iterator drops every stream of the batch.
        """
        batch = [
            self._streams(request, is_decode_handoff(request), alone=False) for request in requests
        ]
        async with aclosing(self._fan_in(batch, n)) as fanned:
            async for delta in fanned:
                yield delta

    def _streams(self, request: PreparedRequest, handoff: bool, *, alone: bool) -> RequestStreams:
        """The request's streams; read in the consumer's own task (``inline``) when it is the
        only request and has one stream that is no hand-off."""
        messages = self._lifecycle.encode(request)
        unary = not request.stream and not handoff
        inline = alone and len(messages) == 1 and not handoff
        return RequestStreams(self._book, request, messages, handoff, unary, inline)

    async def _launch(self, batch: Sequence[RequestStreams]) -> None:
        """Admit the streams of ``batch`` as one (every slot, or none) and launch them."""
        first = batch[0].request
        weight = sum(streams.width for streams in batch)
        grant = self.admission.grant(first.rank, weight, first.priority, first.trace)
        try:
            async with grant:
                for streams in batch:
                    streams.launch(grant)
        except BaseException:
            for streams in batch:
                if streams.handoff and not streams.opened:
                    streams.hand_off_unsent()
            raise

    async def _fan_in(self, batch: Sequence[RequestStreams], n: int) -> AsyncGenerator[Delta, None]:
        """Every stream of ``batch`` read by a task of its own; request k's choice i becomes
        choice ``k * n + i``."""
        try:
            await self._launch(batch)
            owners: dict[asyncio.Future[GenerateResponse], int] = {}
            for k, streams in enumerate(batch):
                owners.update(dict.fromkeys(streams.reads, k))
            async for read, k in FirstDone(owners):
                streams = batch[k]
                stream = streams.reads.pop(read)
                try:
                    response = read.result()
                except BaseException as error:
                    # The choice goes on in a relaunched stream, whose read is new.
                    streams.failed(stream, error)
                    owners.update(dict.fromkeys(streams.reads.keys() - owners.keys(), k))
                    continue
                accept = streams.accept_reply if streams.unary else streams.accept
                delta = accept(stream, response)
                if not stream.done:
                    owners[streams.read(stream)] = k
                if delta is not None:
                    if k:
                        delta.index += k * n
                    yield delta
        finally:
            for streams in batch:
                streams.drop()

    def hand_off_kv(self, request: PreparedRequest, trusted_until: float | None = None) -> None:
        """Have this (decode) engine read the KV a prefill engine holds for ``request``, whose
        client is gone, so that the prefill side frees it now rather than at its lease's end:
        the decode cut to one token, outside admission, dropped after its first token.

        Nothing is sent once ``trusted_until`` has passed: the KV may be freed already.
        Raises EngineUnavailable while this engine is not served (nothing is sent then).
        """
        messages = self._lifecycle.encode(request)
        streams = RequestStreams(self._book, request, messages, True, False, False)
        streams.trusted_until = trusted_until
        streams.hand_off_unsent()

    @property
    def handoff_timeout(self) -> float:
        """How long a hand-off whose client left is read on at most (``decode_handoff_timeout``)."""
        return self._book.handoff_timeout

    # ---------------------------------------------------------------- control

    def sent(self, request_id: str) -> bool:
        """Whether a choice of gateway request ``request_id`` is open on the engine (it has
        left admission); ``Control.Abort`` can only reach a request that is."""
        return bool(self._book.engine_ids(request_id))

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort through ``Control.Abort``: for streams that cannot simply be dropped.

        A gateway request id stands for all of its open choices.
        """
        pool = self._lifecycle.pool
        if pool is None:
            raise self._lifecycle.unavailable()
        ids: list[str] = []
        for rid in request_ids:
            ids.extend(self._book.engine_ids(rid) or (rid,))
        request = control_pb2.AbortRequest(request_ids=list(dict.fromkeys(ids)))
        try:
            await pool.first.control.Abort(request, timeout=CONTROL_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error, self._lifecycle.retry_after) from None

    async def list_loras(self) -> tuple[str, ...]:
        """Names of the loaded LoRA adapters (cached for a few seconds; () when LoRA is off)."""
        return await self._loras.get()
