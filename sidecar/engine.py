"""The sidecar facade: lifecycle, readiness, generation and cancellation.

The app sees only this class. It waits for vLLM's health, discovers and validates the engine,
then keeps watching: readiness drops while vLLM is unhealthy, and on recovery the engine is
re-discovered and must still be the same model with the same layout. Generation fans out
OpenAI ``n`` as ``n`` engine streams, pins each to the router's rank and interleaves their
deltas; closing the generator drops every stream at once, which makes vLLM abort them. A
request that does not stream (``PreparedRequest.stream`` false) uses unary ``Generate`` calls
instead: one reply per choice rather than one message per token, dropped the same way.

Every engine stream holds an admission slot on its rank (``sidecar.admission``) from launch
until it ends, however it ends; a request waits for its slots before anything is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc
import msgspec

from sidecar.admission import Admission
from sidecar.channels import ChannelPool
from sidecar.config import SidecarConfig
from sidecar.convert import DeltaDecoder, RequestEncoder, is_decode_handoff
from sidecar.discovery import Discovered, discover
from sidecar.endpoint import parse_endpoint
from sidecar.errors import (
    DiscoveryError,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    FailedPrecondition,
    InvalidRequest,
    SidecarError,
)
from sidecar.health import HealthWatch, wait_for_serving
from sidecar.proto.vllm import control_pb2
from sidecar.routing.base import Router, RouteTicket
from sidecar.status import error_from_rpc
from sidecar.types import Delta, EngineInfo, PreparedRequest

log = logging.getLogger(__name__)

RANK_METADATA_KEY = "x-data-parallel-rank"
# In-flight requests sent without a rank (vLLM's own balancer chooses) are counted here.
UNPINNED_RANK = -1
CONTROL_RPC_TIMEOUT_S = 10.0
LORA_CACHE_TTL_S = 5.0

# A choice refused by its rank before its first byte is tried on this many other ranks.
MAX_RANK_RETRIES = 2

_EOF = grpc.aio.EOF
_LIST_LORAS_REQUEST = control_pb2.ListLorasRequest()


class _Leg:
    """One engine request (one choice) and its bookkeeping, released exactly once."""

    __slots__ = (
        "avoid",
        "call",
        "decoder",
        "done",
        "handoff",
        "parent",
        "preempted",
        "rank_key",
        "request_id",
        "slot",
        "started",
        "ticket",
    )

    def __init__(
        self,
        call: Any,
        ticket: RouteTicket,
        rank_key: int,
        request_id: str,
        parent: str,
        decoder: DeltaDecoder,
        handoff: bool,
        slot: int | None,
    ) -> None:
        self.call = call
        self.ticket = ticket
        self.rank_key = rank_key
        self.request_id = request_id
        self.parent = parent
        self.decoder = decoder
        self.handoff = handoff
        # The admission key whose slot this stream holds (None: it holds none).
        self.slot = slot
        self.started = False
        self.done = False
        self.preempted = False
        # Ranks that refused this choice already (retries before the first byte).
        self.avoid: tuple[int, ...] = ()


class Sidecar:
    def __init__(
        self, config: SidecarConfig, router: Router, admission: Admission | None = None
    ) -> None:
        self._config = config
        self._router = router
        self.admission = admission or Admission()
        # The ``engine`` policy leaves ranks to vLLM: one pool for the whole group.
        self._group = router.name == "engine"
        self._endpoint = parse_endpoint(config.endpoint)
        self._retry_after = max(1.0, config.health_interval)
        self._pool: ChannelPool | None = None
        self._watch: HealthWatch | None = None
        self._baseline: Discovered | None = None
        self._current: Discovered | None = None
        self._encoder: RequestEncoder | None = None
        self._rank_metadata: dict[int, tuple[tuple[str, str], ...]] = {}
        self._ready = False
        self._closed = False
        self._problem = "the engine has not been discovered yet"
        self._in_flight: dict[int, int] = {}
        self._legs: dict[str, _Leg] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Choices relaunched on another rank after a rank-local refusal (see ``_retry``).
        self.retries = 0
        self._kv_off_logged = False
        self._loras: tuple[float, tuple[str, ...]] | None = None
        self._lora_fetch: asyncio.Task[tuple[str, ...]] | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Wait for vLLM, discover and validate it, configure and start the router, then watch.

        Raises DiscoveryError for an engine Rankgate must not serve and EngineUnavailable when
        the engine is not ready before ``startup_timeout``.
        """
        if self._pool is not None or self._closed:
            raise RuntimeError("Sidecar.start() may be called once")
        config = self._config
        self._pool = ChannelPool(self._endpoint, config.num_channels, config.tls_ca_file)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.startup_timeout
        try:
            await wait_for_serving(self._pool.first.health, deadline, config.retry_interval)
            discovered = await self._discover_until(deadline)
            self._router.configure(discovered.info)
            self.admission.configure(discovered.info, self._group)
            await self._router.start()
        except BaseException:
            pool, self._pool = self._pool, None
            await pool.close()
            raise
        self._baseline = discovered
        self._activate(discovered)
        log.info(
            "serving %s (%s) from vLLM %s at %s: DP ranks %s, block size %d, router %s",
            discovered.info.served_model_name,
            discovered.info.model_id,
            discovered.info.engine_version,
            self._endpoint.target,
            list(discovered.info.ranks),
            discovered.info.block_size,
            self._router.name,
        )
        self._watch = HealthWatch(
            self._pool.first.health, config.health_interval, self._on_serving, self._on_down
        )
        self._watch.start()

    async def close(self) -> None:
        """Stop watching, pre-empt in-flight streams, stop the router and close the channels."""
        if self._closed:
            return
        self._closed = True
        self._ready = False
        self._problem = "the gateway is shutting down"
        self.admission.close(self._shutdown_error())
        if self._watch is not None:
            await self._watch.close()
        for task in list(self._background):
            task.cancel()
        for leg in list(self._legs.values()):
            leg.preempted = True
            leg.call.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for leg in list(self._legs.values()):
            self._release(leg)
        if self._lora_fetch is not None:
            self._lora_fetch.cancel()
        if self._pool is not None:
            await self._router.close()
            await self._pool.close()

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def engine_model(self) -> str:
        """The name vLLM itself serves the model under (``served_model_name`` may rename it
        towards clients); "" before discovery."""
        return self._current.wire_model if self._current is not None else ""

    @property
    def info(self) -> EngineInfo:
        current = self._current
        if not self._ready or current is None:
            raise EngineUnavailable(self._problem, self._retry_after)
        return current.info

    def in_flight(self) -> dict[int, int]:
        """Engine requests this gateway has open, per pinned rank (``UNPINNED_RANK`` for those
        sent without a rank). Every served rank is listed, idle ones with 0."""
        counts = dict.fromkeys(self._current.info.ranks, 0) if self._current else {}
        counts.update(self._in_flight)
        return counts

    async def _discover_until(self, deadline: float) -> Discovered:
        loop = asyncio.get_running_loop()
        while True:
            remaining = deadline - loop.time()
            try:
                return await self._discover(min(max(remaining, 0.1), CONTROL_RPC_TIMEOUT_S))
            except EngineUnavailable as error:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise EngineUnavailable(
                        f"engine not discovered before the startup deadline: {error.message}"
                    ) from None
                await asyncio.sleep(min(self._config.retry_interval, remaining))

    async def _discover(self, rpc_timeout: float) -> Discovered:
        assert self._pool is not None
        stubs = self._pool.first
        return await discover(
            stubs.control,
            stubs.kv_transfer,
            self._endpoint.host,
            self._config.served_model_name,
            rpc_timeout,
        )

    def _activate(self, discovered: Discovered) -> None:
        previous = self._current
        self._current = discovered
        if previous is None or previous.wire_model != discovered.wire_model:
            self._encoder = RequestEncoder(discovered.wire_model)
        if previous is None or previous.info.ranks != discovered.info.ranks:
            self._rank_metadata = {
                rank: ((RANK_METADATA_KEY, str(rank)),) for rank in discovered.info.ranks
            }
        if not discovered.info.kv_event_sources and not self._kv_off_logged:
            self._kv_off_logged = True
            log.info("vLLM advertises no KV-event sources: KV-aware routing is off")
        self._problem = ""
        self._ready = True

    def _on_down(self, reason: str) -> None:
        self._ready = False
        self._problem = f"the engine is unhealthy: {reason}"
        log.warning("vLLM is not serving (%s); requests get 503 until it recovers", reason)

    async def _on_serving(self) -> bool:
        """Re-discover; serve again only when the engine is still the one we started with."""
        assert self._baseline is not None
        try:
            discovered = await self._discover(CONTROL_RPC_TIMEOUT_S)
        except EngineUnavailable as error:
            self._set_problem(f"the engine is unavailable: {error.message}", logging.WARNING)
            return False
        except DiscoveryError as error:
            self._set_problem(f"the engine failed validation: {error.message}", logging.ERROR)
            return False
        changes = discovered.identity.changes_from(self._baseline.identity)
        if changes:
            self._set_problem(
                "the engine changed since startup; refusing to serve it until it is restored "
                "or the gateway restarts: " + "; ".join(changes),
                logging.ERROR,
            )
            return False
        current = self._current
        assert current is not None
        if (
            current.info.instance_id != discovered.info.instance_id
            or current.info.kv_event_sources != discovered.info.kv_event_sources
            or current.info.capacity != discovered.info.capacity
        ):
            log.info(
                "vLLM instance %r replaced %r; reconfiguring the router",
                discovered.info.instance_id,
                current.info.instance_id,
            )
            self._router.configure(discovered.info)
            self.admission.configure(discovered.info, self._group)
        if not self._ready:
            log.info("vLLM is serving again")
        self._activate(discovered)
        return True

    def _set_problem(self, problem: str, level: int) -> None:
        self._ready = False
        if problem != self._problem:
            log.log(level, "%s", problem)
        self._problem = problem

    # ---------------------------------------------------------------- generation

    async def generate(
        self, request: PreparedRequest, *, decode_handoff: bool = False
    ) -> AsyncGenerator[Delta, None]:
        """Stream the deltas of every choice of ``request``, interleaved as they arrive.

        Raises the typed errors of ``sidecar.errors``; nothing is sent to the engine when the
        request fails validation or admission (GatewayOverloaded when no slot frees in time).
        Each choice's stream holds a slot on the rank it runs on. Closing the iterator (or
        cancelling its consumer) drops all of the request's streams at once, except a
        disaggregated decode (``decode_handoff``, or params marked ``do_remote_prefill``) that
        has not produced its first token yet: that one is read on in the background, at most
        ``decode_handoff_timeout`` seconds.
        """
        current = self._current
        encoder = self._encoder
        if not self._ready or current is None or encoder is None:
            raise EngineUnavailable(self._problem, self._retry_after)
        if request.rank is not None and request.rank not in current.info.ranks:
            raise InvalidRequest(
                f"data-parallel rank {request.rank} is not served here; "
                f"ranks: {list(current.info.ranks)}"
            )
        messages = encoder.encode(request)
        handoff = decode_handoff or is_decode_handoff(request)
        want_logprobs = request.output.logprobs is not None
        unary = not request.stream and not handoff
        legs: list[_Leg] = []
        reads: dict[asyncio.Task[Any], _Leg] = {}
        yielded = False
        admission = self.admission
        key = admission.key_of(request.rank)
        waited = not admission.fits(key, len(messages))
        try:
            if waited:
                await admission.wait(key, len(messages), request.priority)
            try:
                for choice, message in enumerate(messages):
                    legs.append(
                        self._launch(request, choice, message, want_logprobs, handoff, unary)
                    )
            finally:
                if waited:
                    admission.settle()
            if unary and len(legs) == 1:
                # One reply message instead of one per token: a fraction of the gRPC work.
                leg = legs[0]
                while True:
                    try:
                        response = await leg.call
                        break
                    except grpc.aio.AioRpcError as error:
                        retry = self._retry_or_raise(
                            leg, error, True, request, messages, want_logprobs, unary=True
                        )
                        legs.append(retry)
                        leg = retry
                    except asyncio.CancelledError:
                        if self._preempted(leg):
                            raise self._shutdown_error() from None
                        raise
                yield self._on_reply(leg, response)
            elif unary:
                for leg in legs:
                    reads[asyncio.ensure_future(leg.call)] = leg
                while reads:
                    done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        leg = reads.pop(task)
                        try:
                            response = task.result()
                        except grpc.aio.AioRpcError as error:
                            retry = self._retry_or_raise(
                                leg, error, not yielded, request, messages, want_logprobs, True
                            )
                            legs.append(retry)
                            reads[asyncio.ensure_future(retry.call)] = retry
                            continue
                        except asyncio.CancelledError:
                            if self._preempted(leg):
                                raise self._shutdown_error() from None
                            raise
                        yielded = True
                        yield self._on_reply(leg, response)
            elif len(legs) == 1 and not handoff:
                # The common case reads in the consumer's own task: no extra task per token,
                # and the call's own iterator, the cheapest way grpc.aio hands out messages.
                leg = legs[0]
                responses = leg.call.__aiter__()
                while True:
                    try:
                        response = await anext(responses)
                    except StopAsyncIteration:
                        raise self._truncated(leg) from None
                    except grpc.aio.AioRpcError as error:
                        retry = self._retry_or_raise(
                            leg, error, not yielded, request, messages, want_logprobs
                        )
                        legs.append(retry)
                        leg = retry
                        responses = leg.call.__aiter__()
                        continue
                    except asyncio.CancelledError:
                        if self._preempted(leg):
                            raise self._shutdown_error() from None
                        raise
                    delta = self._on_response(leg, response)
                    if delta is not None:
                        yielded = True
                        yield delta
                        if leg.done:
                            return
            else:
                for leg in legs:
                    reads[asyncio.ensure_future(leg.call.read())] = leg
                while reads:
                    done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        leg = reads.pop(task)
                        try:
                            response = task.result()
                        except grpc.aio.AioRpcError as error:
                            retry = self._retry_or_raise(
                                leg, error, not yielded, request, messages, want_logprobs
                            )
                            legs.append(retry)
                            reads[asyncio.ensure_future(retry.call.read())] = retry
                            continue
                        except asyncio.CancelledError:
                            if self._preempted(leg):
                                raise self._shutdown_error() from None
                            raise
                        if response is _EOF:
                            raise self._truncated(leg)
                        delta = self._on_response(leg, response)
                        if not leg.done:
                            reads[asyncio.ensure_future(leg.call.read())] = leg
                        if delta is not None:
                            yielded = True
                            yield delta
        finally:
            self._drop(legs, reads)

    def _launch(
        self,
        request: PreparedRequest,
        choice: int,
        message: Any,
        want_logprobs: bool,
        handoff: bool,
        unary: bool = False,
    ) -> _Leg:
        assert self._pool is not None
        admission = self.admission
        ticket = self._router.route(request, choice, admission.full)
        rank = request.rank if request.rank is not None else ticket.decision.rank
        metadata = None
        if rank is not None:
            metadata = self._rank_metadata.get(rank) or ((RANK_METADATA_KEY, str(rank)),)
        try:
            inference = self._pool.pick().inference
            if unary:
                call = inference.Generate(message, metadata=metadata)
            else:
                call = inference.GenerateStream(message, metadata=metadata)
        except BaseException:
            ticket.finished()
            raise
        key = UNPINNED_RANK if rank is None else rank
        slot = admission.key_of(rank)
        if slot is not None:
            admission.take(slot)
        leg = _Leg(
            call,
            ticket,
            key,
            message.request_id,
            request.request_id,
            DeltaDecoder(choice, want_logprobs),
            handoff,
            slot,
        )
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        self._legs[leg.request_id] = leg
        if unary:
            # A unary reply hides when prefill ends. Counting the request as decoding from
            # the start errs by its prefill time; counting it as prefilling until the reply
            # would overstate its load tenfold for the whole of its decode.
            leg.started = True
            ticket.first_token()
        return leg

    def _retry_or_raise(
        self,
        leg: _Leg,
        error: grpc.aio.AioRpcError,
        may_retry: bool,
        request: PreparedRequest,
        messages: Sequence[Any],
        want_logprobs: bool,
        unary: bool = False,
    ) -> _Leg:
        """The relaunched leg for a failed call, or the call's typed error raised."""
        failure = self._failure(leg, error)
        retry = None
        if may_retry:
            retry = self._retry(leg, failure, request, messages, want_logprobs, unary)
        if retry is None:
            raise failure from None
        return retry

    def _retry(
        self,
        leg: _Leg,
        failure: SidecarError,
        request: PreparedRequest,
        messages: Sequence[Any],
        want_logprobs: bool,
        unary: bool = False,
    ) -> _Leg | None:
        """Relaunch a choice that its rank refused before anything reached the client.

        Only failures local to one rank qualify: RESOURCE_EXHAUSTED or an internal error from
        a rank the router chose (never one the client pinned, never a decode hand-off, never
        an engine that is unavailable as a whole). The next rank is the least loaded one not
        tried yet that has an admission slot free; at most ``MAX_RANK_RETRIES`` times per
        choice. The new rank's slot is taken before the refusing rank's is given back.
        """
        current = self._current
        if (
            request.rank is not None
            or leg.handoff
            or leg.rank_key == UNPINNED_RANK
            or current is None
            or len(leg.avoid) >= MAX_RANK_RETRIES
            or not isinstance(failure, (EngineOverloaded, EngineFailure))
        ):
            return None
        avoid = (*leg.avoid, leg.rank_key)
        full = self.admission.full
        others = [rank for rank in current.info.ranks if rank not in avoid and rank not in full]
        if not others:
            return None
        target = min(others, key=lambda rank: self._in_flight.get(rank, 0))
        log.info(
            "request %s: rank %d refused it (%s); retrying on rank %d",
            leg.request_id,
            leg.rank_key,
            failure.message,
            target,
        )
        choice = leg.decoder.index
        retry = self._launch(
            msgspec.structs.replace(request, rank=target),
            choice,
            messages[choice],
            want_logprobs,
            False,
            unary,
        )
        retry.avoid = avoid
        self._release(leg)
        self.retries += 1
        return retry

    def _on_reply(self, leg: _Leg, response: Any) -> Delta:
        """The whole output of a unary call as one delta; a reply without a finish is an
        engine failure, as a stream that ends early is."""
        delta = self._on_response(leg, response)
        if delta is None or not leg.done:
            raise self._truncated(leg)
        return delta

    def _on_response(self, leg: _Leg, response: Any) -> Delta | None:
        delta = leg.decoder.feed(response)
        if delta is None:
            return None
        if delta.prompt_tokens is not None:
            # A choice's first delta says where it ran (for the access log and metrics).
            delta.rank = None if leg.rank_key == UNPINNED_RANK else leg.rank_key
            delta.cached_tokens = leg.ticket.decision.cached_tokens
            delta.route = leg.ticket.decision.header()
        if not leg.started and delta.token_ids:
            leg.started = True
            leg.ticket.first_token()
        if delta.finish_reason is not None:
            self._release(leg)
        return delta

    def _release(self, leg: _Leg) -> None:
        if leg.done:
            return
        leg.done = True
        leg.ticket.finished()
        if leg.slot is not None:
            self.admission.give(leg.slot)
        remaining = self._in_flight.get(leg.rank_key, 0) - 1
        if remaining > 0:
            self._in_flight[leg.rank_key] = remaining
        else:
            self._in_flight.pop(leg.rank_key, None)
        self._legs.pop(leg.request_id, None)

    def _drop(self, legs: list[_Leg], reads: dict[asyncio.Task[Any], _Leg]) -> None:
        """Cancel every unfinished leg now; decode hand-offs finish their first token first."""
        pending = {leg: task for task, leg in reads.items()}
        for task, leg in reads.items():
            if leg.handoff and not leg.started and not leg.done and not self._closed:
                continue
            if task.done():
                if not task.cancelled():
                    task.exception()
            else:
                task.cancel()
                task.add_done_callback(_consume_result)
        for leg in legs:
            if leg.done:
                continue
            if leg.handoff and not leg.started and not self._closed:
                self._spawn(self._finish_handoff(leg, pending.get(leg)))
                continue
            leg.call.cancel()
            self._release(leg)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish_handoff(self, leg: _Leg, read: asyncio.Task[Any] | None) -> None:
        """Keep reading a cancelled decode request until its first token or its end (SPEC.md
        section 8), so the KV transfer it started completes and its blocks are released; drop
        it then, or when ``decode_handoff_timeout`` runs out, or when the gateway shuts down.
        """
        loop = asyncio.get_running_loop()
        timeout = self._config.decode_handoff_timeout
        deadline = loop.time() + timeout
        try:
            while True:
                if read is None:
                    read = asyncio.ensure_future(leg.call.read())
                done, _ = await asyncio.wait({read}, timeout=max(deadline - loop.time(), 0.0))
                if not done:
                    log.warning(
                        "decode request %s had no first token %.1f s after its client left; "
                        "dropping it (its KV transfer may be stranded)",
                        leg.request_id,
                        timeout,
                    )
                    break
                response, read = read.result(), None
                if response is _EOF:
                    break
                output = response.outputs
                if output.token_ids or output.HasField("finish_info"):
                    break
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            if read is not None and not read.done():
                read.cancel()
                read.add_done_callback(_consume_result)
            leg.call.cancel()
            self._release(leg)

    def _failure(self, leg: _Leg, error: grpc.aio.AioRpcError) -> SidecarError:
        mapped = error_from_rpc(error, self._retry_after)
        if isinstance(mapped, (EngineUnavailable, EngineFailure)):
            log.warning("request %s failed: %s", leg.request_id, mapped.message)
            if self._watch is not None:
                self._watch.nudge()
        return mapped

    @staticmethod
    def _preempted(leg: _Leg) -> bool:
        """A read ended in CancelledError because ``close()`` dropped the stream under a live
        consumer, rather than because the consumer itself was cancelled."""
        task = asyncio.current_task()
        return leg.preempted and task is not None and not task.cancelling()

    def _shutdown_error(self) -> EngineUnavailable:
        return EngineUnavailable("the gateway is shutting down", self._retry_after)

    def _truncated(self, leg: _Leg) -> EngineFailure:
        if self._watch is not None:
            self._watch.nudge()
        return EngineFailure(f"the engine ended request {leg.request_id} without finishing it")

    # ---------------------------------------------------------------- control

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort through ``Control.Abort``: for streams that cannot simply be dropped.

        A gateway request id stands for all of its open choices.
        """
        if self._pool is None:
            raise EngineUnavailable(self._problem, self._retry_after)
        ids: list[str] = []
        for rid in request_ids:
            choices = [leg.request_id for leg in self._legs.values() if leg.parent == rid]
            ids.extend(choices or (rid,))
        request = control_pb2.AbortRequest(request_ids=list(dict.fromkeys(ids)))
        try:
            await self._pool.first.control.Abort(request, timeout=CONTROL_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error, self._retry_after) from None

    async def list_loras(self) -> tuple[str, ...]:
        """Names of the loaded LoRA adapters (cached for a few seconds; () when LoRA is off)."""
        loop = asyncio.get_running_loop()
        cached = self._loras
        if cached is not None and loop.time() - cached[0] < LORA_CACHE_TTL_S:
            return cached[1]
        if self._pool is None:
            raise EngineUnavailable(self._problem, self._retry_after)
        if self._lora_fetch is None or self._lora_fetch.done():
            self._lora_fetch = loop.create_task(self._fetch_loras())
        return await asyncio.shield(self._lora_fetch)

    async def _fetch_loras(self) -> tuple[str, ...]:
        assert self._pool is not None
        try:
            response = await self._pool.first.control.ListLoras(
                _LIST_LORAS_REQUEST, timeout=CONTROL_RPC_TIMEOUT_S
            )
            names = tuple(sorted(adapter.lora_name for adapter in response.adapters))
        except grpc.aio.AioRpcError as error:
            mapped = error_from_rpc(error, self._retry_after)
            if not isinstance(mapped, FailedPrecondition):
                raise mapped from None
            names = ()
        self._loras = (asyncio.get_running_loop().time(), names)
        return names


def _consume_result(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
