"""Disaggregated serving: prefill on one vLLM frontend, decode on another, one face to the app.

Each side is a full :class:`~rankgate.sidecar.engine.Sidecar` (its own discovery, health watch,
router and KV index over its own DP ranks). A request runs as a one-token prefill on the prefill
side marked ``do_remote_decode``; the prefill's ``FinishInfo.kv_transfer_params`` then go, as they
came, to the decode side with the original prompt and images, so both engines prepare images
the same way. The client only ever sees the decode's deltas, so usage and streaming look
exactly as they do when one engine serves both phases.

Cancellation (SPEC.md section 8): a prefill whose client leaves is aborted through
``Control.Abort`` and read to its end, and if it had finished, the decode side reads its KV
and drops it, so no prefill's blocks wait out vLLM's KV lease. Once the decode has been
submitted, the decode sidecar owns the hand-off: until the first token it
keeps reading in the background (bounded by ``decode_handoff_timeout``), so the engine's KV
transfer completes; after it, the stream is dropped at once. Shutdown pre-empts the drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from rankgate.sidecar import pd_seed
from rankgate.sidecar.admission import Admission
from rankgate.sidecar.config import DisaggConfig
from rankgate.sidecar.disagg_metrics import DisaggMetrics
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.errors import (
    BadEngineResponse,
    DiscoveryError,
    EngineUnavailable,
    InvalidRequest,
    KvLeaseExpired,
    SidecarError,
)
from rankgate.sidecar.fan_in import interleave, merge_batch
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.hashing import image_runs
from rankgate.sidecar.routing.policies.ranked import prompt_tokens
from rankgate.sidecar.types import (
    Delta,
    EngineInfo,
    MediaInput,
    OutputOptions,
    PreparedRequest,
    SamplingParams,
    StoppingParams,
)

log = logging.getLogger(__name__)

# What vLLM's KV connectors expect on the prefill request (as vLLM's P/D proxies send it).
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_SAMPLING = SamplingParams(temperature=0.0)
_PREFILL_STOPPING = StoppingParams(max_tokens=1, min_tokens=1)
_PREFILL_OUTPUT = OutputOptions()
# With images, the prefill reports the expanded prompt: it tells the decode router how many
# tokens an image it has not seen before expands to.
_PREFILL_OUTPUT_WITH_IDS = OutputOptions(prompt_token_ids=True)
_INT64 = 1 << 63


class Prefilled(msgspec.Struct, frozen=True):
    """A finished remote prefill: its transfer params, the expanded prompt's length and (with
    images) ids, and when the gateway saw it finish (``time.monotonic()``)."""

    params: dict[str, Any]
    expanded: int
    expanded_ids: tuple[int, ...]
    finished_at: float
    # The prefill's last delta, with its sampled token when it was sampled for the client.
    last: Delta


def routing_for(base: RoutingConfig) -> RoutingConfig:
    """The routing of either side: ``base`` with requests in flight weighed like uncached
    prompt tokens, every one of them (``decode_weight`` 1, no ``decode_tokens_cap``).

    A prefill request is unary, so the router counts its whole prompt as in flight from the
    start: on the prefill side that is exactly the prefill queued there, as costly per token
    as the uncached prompt of the request being placed. On the decode side, running sequences
    are the load, and the uncached prompt is KV still to pull rather than to compute: both
    matter more there than in aggregated serving, where decode counts a tenth.
    """
    return msgspec.structs.replace(base, decode_weight=1.0, decode_tokens_cap=0)


class DisaggregatedEngine:
    """Serves generation across a prefill sidecar and a decode sidecar (the app's ``Engine``)."""

    def __init__(
        self,
        prefill: Sidecar,
        decode: Sidecar,
        config: DisaggConfig | None = None,
        metrics: DisaggMetrics | None = None,
    ) -> None:
        self._prefill = prefill
        self._decode = decode
        self._config = config or DisaggConfig()
        self._metrics = metrics or DisaggMetrics(CollectorRegistry())
        self._info: tuple[EngineInfo, EngineInfo, EngineInfo] | None = None
        # Prefills whose client left, being aborted and read to their end.
        self._settling: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start both sides at once; both must serve the same model.

        Raises the first side's startup error (named by side), or DiscoveryError naming both
        models when they differ; nothing is left running on failure.
        """
        results = await asyncio.gather(
            self._prefill.start(), self._decode.start(), return_exceptions=True
        )
        failures = [
            (side, result)
            for side, result in zip(("prefill", "decode"), results, strict=True)
            if isinstance(result, BaseException)
        ]
        if failures:
            await self.close()
            side, error = failures[0]
            if isinstance(error, (DiscoveryError, EngineUnavailable)):
                raise type(error)(f"{side} engine: {error.message}") from error
            raise error
        prefill_model = self._prefill.engine_model
        decode_model = self._decode.engine_model
        if prefill_model != decode_model:
            await self.close()
            raise DiscoveryError(
                f"the prefill engine serves model {prefill_model!r} but the decode engine "
                f"serves {decode_model!r}: both sides must serve the same model"
            )
        prefill, decode = self._prefill.info, self._decode.info
        log.info(
            "disaggregated serving of %s: prefill DP ranks %s, decode DP ranks %s",
            decode_model,
            list(prefill.ranks),
            list(decode.ranks),
        )

    async def close(self) -> None:
        """Close both sides; pending hand-offs and prefill aborts are dropped, not drained."""
        for task in list(self._settling):
            task.cancel()
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        await asyncio.gather(self._prefill.close(), self._decode.close())

    @property
    def ready(self) -> bool:
        return self._prefill.ready and self._decode.ready

    @property
    def admission(self) -> Admission:
        """The decode side's admission (each side admits against its own ranks; a request
        holds a prefill slot while its prefill runs, then a decode slot)."""
        return self._decode.admission

    @property
    def info(self) -> EngineInfo:
        """The decode side's description, limited to what both sides can serve."""
        prefill = _side_info(self._prefill, "prefill")
        decode = _side_info(self._decode, "decode")
        cached = self._info
        if cached is not None and cached[0] is prefill and cached[1] is decode:
            return cached[2]
        merged = msgspec.structs.replace(
            decode,
            max_model_len=min(prefill.max_model_len, decode.max_model_len),
            supports_multimodal=prefill.supports_multimodal and decode.supports_multimodal,
            supports_lora=prefill.supports_lora and decode.supports_lora,
            supports_text_input=prefill.supports_text_input and decode.supports_text_input,
        )
        self._info = (prefill, decode, merged)
        return merged

    async def list_loras(self) -> tuple[str, ...]:
        """Adapters loaded on both sides (a request's LoRA must run on each)."""
        prefill, decode = await asyncio.gather(
            self._prefill.list_loras(), self._decode.list_loras()
        )
        on_prefill = frozenset(prefill)
        return tuple(name for name in decode if name in on_prefill)

    # ---------------------------------------------------------------- generation

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[Delta, None]:
        """The decode's deltas for every choice of ``request`` (``n`` prefill/decode pairs).

        Raises the typed errors of ``rankgate.sidecar.errors``: a prefill failure reaches the caller
        and no decode is sent; a prefill without ``kv_transfer_params`` is BadEngineResponse.
        """
        _side_info(self._prefill, "prefill")
        _side_info(self._decode, "decode")
        if request.kv_transfer_params:
            raise InvalidRequest(
                "kv_transfer_params are set by the gateway itself when it serves prefill and "
                "decode on separate engines",
                param="kv_transfer_params",
            )
        if request.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {request.n}", param="n")
        if request.n == 1:
            pipeline = self._choice(request, 0)
            try:
                async for delta in pipeline:
                    yield delta
            finally:
                await pipeline.aclose()
            return
        choices = interleave([self._choice(request, i) for i in range(request.n)])
        try:
            async for _, delta in choices:
                yield delta
        finally:
            await choices.aclose()

    def generate_batch(
        self, requests: Sequence[PreparedRequest], n: int
    ) -> AsyncGenerator[Delta, None]:
        """The deltas of every request of a batch, request k's choice i as choice
        ``k * n + i``; each request is admitted on each side as it reaches it."""
        return merge_batch([self.generate(request) for request in requests], n)

    def placement(self, request: PreparedRequest) -> tuple[str, str]:
        """Where to prefill ``request`` (``remote`` or ``local``) and why, from what each
        costs now (see :class:`DisaggConfig`)."""
        config = self._config
        if request.output.prompt_logprobs is not None:
            # Prompt logprobs come out of a prefill's forward pass, and vLLM's transfer moves
            # KV, not logprobs: such a request is prefilled where it decodes.
            return "local", "prompt_logprobs"
        if config.prefill_mode != "auto":
            return config.prefill_mode, "pinned"
        if request.rank is not None:
            # A client's rank pin names a decode rank, whose cache the pin is about.
            local = self._decode.prefill_cost(msgspec.structs.replace(request, rank=None))
        else:
            local = self._decode.prefill_cost(request)
        threshold = config.local_prefill_tokens
        if local.uncached <= threshold:
            short = local.uncached == prompt_tokens(request) or prompt_tokens(request) <= threshold
            return "local", "short" if short else "decode_cached"
        remote = self._prefill.prefill_cost(request)
        remote_cost = remote.uncached + remote.load + config.transfer_token_cost * local.uncached
        local_cost = config.local_prefill_weight * local.uncached + local.load
        if local_cost < remote_cost:
            return "local", "prefill_busy" if remote.load else "decode_cached"
        return "remote", "cheaper"

    async def _choice(self, request: PreparedRequest, choice: int) -> AsyncGenerator[Delta, None]:
        decode = _single_choice(request, choice)
        where, reason = self.placement(decode)
        self._metrics.prefills.labels(where, reason).inc()
        stream = self._local(decode) if where == "local" else self._remote(decode)
        try:
            async for delta in stream:
                if choice:
                    delta.index = choice
                yield delta
        finally:
            await stream.aclose()

    def _local(self, request: PreparedRequest) -> AsyncGenerator[Delta, None]:
        """The decode engine prefills ``request`` itself: the aggregated path on that side."""
        return self._decode.generate(request)

    async def _remote(self, decode: PreparedRequest) -> AsyncGenerator[Delta, None]:
        # Seeding shows a streaming client its first token early; a whole answer gains
        # nothing from it.
        seed = self._config.seed_first_token and decode.stream and pd_seed.reproducible(decode)
        # The prefill runs in a task of its own: a client that leaves mid-prefill must not
        # cut it off unseen (see _settle_prefill).
        outcome = asyncio.ensure_future(self._run_prefill(decode, seed))
        try:
            prefilled = await asyncio.shield(outcome)
        except BaseException:
            self._settle_prefill(outcome, decode)
            raise
        if isinstance(prefilled, Delta):
            yield prefilled
            return
        trusted_until = prefilled.finished_at + self._config.trust_window
        seeded: Delta | None = None
        if seed:
            seeded = prefilled.last
            if pd_seed.ends_answer(seeded, decode):
                # The first token is the whole answer; the decode side still reads the KV
                # (and drops it), so the prefill engine frees it now.
                self._metrics.seeded.labels("whole_answer").inc()
                self._hand_off(_decode_request(decode, prefilled), trusted_until)
                yield pd_seed.answer(seeded)
                return
            if pd_seed.held_back(seeded):
                self._metrics.seeded.labels("held_back").inc()
                seeded = None
            else:
                self._metrics.seeded.labels("first_token").inc()
                try:
                    yield pd_seed.opening(seeded)
                except BaseException:
                    # The client left with its first token, before the decode was sent: the
                    # decode side reads the KV and drops it, so the prefill engine frees it
                    # now rather than at the end of its lease.
                    self._hand_off(_decode_request(decode, prefilled), trusted_until)
                    raise
        stream: AsyncGenerator[Delta, Any] = self._decode.generate(
            _decode_request(decode, prefilled), decode_handoff=True, trusted_until=trusted_until
        )
        try:
            head = await self._first_in_trust(stream, decode.request_id, prefilled)
            if head is None:
                # Not answered from KV that may be gone: the decode engine prefills it anew.
                await stream.aclose()
                again = msgspec.structs.replace(decode, request_id=f"{decode.request_id}.local")
                stream = self._local(again)
            else:
                stream = _chained(head, stream)
            if seeded is not None:
                stream = pd_seed.after_seed(stream, seeded, self._seed_mismatch(decode))
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    def _seed_mismatch(self, request: PreparedRequest) -> Callable[[int, int], None]:
        def mismatch(seeded: int, decoded: int) -> None:
            self._metrics.seeded.labels("mismatch").inc()
            log.warning(
                "the decode of %s sampled token %d first where its prefill sampled %d; the "
                "client has the prefill's",
                request.request_id,
                decoded,
                seeded,
            )

        return mismatch

    def _hand_off(self, decode: PreparedRequest, trusted_until: float) -> None:
        try:
            self._decode.hand_off_kv(decode, trusted_until)
        except SidecarError as error:  # the KV then waits out its lease: say so
            log.warning("could not hand off the KV of %s: %s", decode.request_id, error.message)

    async def _first_in_trust(
        self, stream: AsyncGenerator[Delta, None], request_id: str, prefilled: Prefilled
    ) -> Delta | None:
        """The decode's first delta if it comes while the prefill's KV is surely held; None
        (the decode dropped, counted) if not.

        A decode that produced a token had read its KV by then. One that has not, when the
        lease can have ended, may yet read blocks the prefill engine released and reused,
        and answer from garbage: vLLM reports no error for that. It is given up instead,
        unsent if it still waits for a slot; if it was sent, the hand-off drain reads it to
        its first token and drops it.
        """
        metrics = self._metrics
        remaining = prefilled.finished_at + self._config.trust_window - time.monotonic()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                first = await anext(stream, None)
        except (TimeoutError, KvLeaseExpired):
            stage = "sent" if self._decode.sent(request_id) else "queued"
        else:
            metrics.kv_wait.observe(time.monotonic() - prefilled.finished_at)
            return first
        waited = time.monotonic() - prefilled.finished_at
        metrics.kv_wait.observe(waited)
        metrics.lease_missed.labels(stage).inc()
        log.warning(
            "the decode of %s had not started %.1f s after its prefill finished (%s), when "
            "the prefill engine's KV lease (%.0f s) can end: prefilling it on the decode "
            "engine instead",
            request_id,
            waited,
            "sent to the decode engine" if stage == "sent" else "waiting for a decode slot",
            self._config.kv_lease,
        )
        return None

    def _settle_prefill(
        self, outcome: asyncio.Future[Prefilled | Delta], decode: PreparedRequest
    ) -> None:
        """The client left while the prefill of ``decode`` ran: end it without stranding KV.

        Dropping the prefill's stream aborts it, and an aborted prefill frees its blocks; but
        a prefill that finished a moment before the drop keeps its blocks for a decode that
        never comes, until vLLM's KV lease (30 s) ends. So a prefill already on the engine is
        stopped through ``Control.Abort`` and read to its end, bounded by the decode side's
        hand-off timeout: aborted, it is done; finished, the decode side reads its KV and
        drops it (:meth:`Sidecar.hand_off_kv`). One still waiting for a prefill slot was never
        sent and is simply cancelled.
        """
        if outcome.done():
            self._hand_off_if_finished(outcome, decode)
            return
        if not self._prefill.sent(decode.request_id):
            outcome.cancel()
            return
        task = asyncio.get_running_loop().create_task(self._abort_prefill(outcome, decode))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _abort_prefill(
        self, outcome: asyncio.Future[Prefilled | Delta], decode: PreparedRequest
    ) -> None:
        try:
            try:
                await self._prefill.abort([decode.request_id])
            except SidecarError as error:
                log.warning(
                    "could not abort the prefill of %s after its client left: %s",
                    decode.request_id,
                    error.message,
                )
                outcome.cancel()
            timeout = self._decode.handoff_timeout
            done, _ = await asyncio.wait({outcome}, timeout=timeout)
            if not done:
                log.warning(
                    "the prefill of %s had not ended %.1f s after its client left; dropping "
                    "it (its KV may be held until its lease ends)",
                    decode.request_id,
                    timeout,
                )
                return
            self._hand_off_if_finished(outcome, decode)
        finally:
            # Past the bound, or at shutdown (which cancels this task), the stream is dropped.
            outcome.cancel()

    def _hand_off_if_finished(
        self, outcome: asyncio.Future[Prefilled | Delta], decode: PreparedRequest
    ) -> None:
        """A prefill that ended with KV held for ``decode``: the decode side reads and drops it."""
        if outcome.cancelled() or outcome.exception() is not None:
            return
        prefilled = outcome.result()
        if isinstance(prefilled, Delta):
            return
        self._hand_off(
            _decode_request(decode, prefilled), prefilled.finished_at + self._config.trust_window
        )

    async def _run_prefill(self, request: PreparedRequest, seed: bool) -> Prefilled | Delta:
        """Run the one-token prefill; its transfer params and expanded prompt length, or the
        finishing delta to hand the client when the prefill was aborted engine-side. With
        ``seed`` its token is sampled as the client asked, to be the client's first."""
        output = _PREFILL_OUTPUT_WITH_IDS if request.media else _PREFILL_OUTPUT
        if seed:
            output = msgspec.structs.replace(request.output, prompt_token_ids=bool(request.media))
        prefill = PreparedRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            prompt_text=request.prompt_text,
            sampling=request.sampling if seed else _PREFILL_SAMPLING,
            stopping=pd_seed.prefill_stopping(request) if seed else _PREFILL_STOPPING,
            structured=request.structured if seed else None,
            output=output,
            cache_salt=request.cache_salt,
            priority=request.priority,
            lora_name=request.lora_name,
            media=request.media,
            kv_transfer_params=PREFILL_TRANSFER_PARAMS,
            # One reply instead of a stream: less gRPC work for the prefill leg.
            stream=False,
        )
        stream = self._prefill.generate(prefill)
        expanded = 0
        expanded_ids: tuple[int, ...] = ()
        last: Delta | None = None
        try:
            async for delta in stream:
                if delta.prompt_token_ids is not None:
                    expanded_ids = tuple(delta.prompt_token_ids)
                    expanded = len(expanded_ids)
                elif delta.prompt_tokens is not None:
                    expanded = delta.prompt_tokens
                last = delta
        finally:
            await stream.aclose()
        if last is None or last.finish_reason is None:
            raise BadEngineResponse(
                f"the prefill engine ended request {request.request_id} without finishing it"
            )
        if last.finish_reason == "abort":
            return Delta(finish_reason="abort", completion_tokens=0, prompt_tokens=expanded)
        params = last.kv_transfer_params
        if not params:
            raise BadEngineResponse(
                f"the prefill engine finished request {request.request_id} without "
                "kv_transfer_params, so there is no KV for a decode engine to pull; check that "
                "it runs with a KV connector (kv_role kv_producer or kv_both)"
            )
        return Prefilled(params, expanded, expanded_ids, time.monotonic(), last)


async def _chained(head: Delta, rest: AsyncGenerator[Delta, None]) -> AsyncGenerator[Delta, None]:
    try:
        yield head
        async for delta in rest:
            yield delta
    finally:
        await rest.aclose()


def _side_info(sidecar: Sidecar, side: str) -> EngineInfo:
    try:
        return sidecar.info
    except EngineUnavailable as error:
        raise EngineUnavailable(f"{side} engine: {error.message}", error.retry_after) from None


def _decode_request(decode: PreparedRequest, prefilled: Prefilled) -> PreparedRequest:
    """``decode`` carrying its prefill's transfer params, its images' sizes learned from it."""
    media = decode.media
    if media:
        media = learned_media(
            media, len(decode.prompt_token_ids), prefilled.expanded, prefilled.expanded_ids
        )
    return msgspec.structs.replace(decode, kv_transfer_params=prefilled.params, media=media)


def _single_choice(request: PreparedRequest, choice: int) -> PreparedRequest:
    """Choice ``choice`` as a request of its own, seeded ``seed + choice`` as the aggregated
    path seeds it; with one choice, the request itself."""
    if request.n == 1:
        return request
    sampling = request.sampling
    seed = sampling.seed
    if seed is not None and -_INT64 <= seed < _INT64:
        seed = (seed + choice + _INT64) % (2 * _INT64) - _INT64
        sampling = msgspec.structs.replace(sampling, seed=seed)
    return msgspec.structs.replace(
        request, request_id=f"{request.request_id}.{choice}", n=1, sampling=sampling
    )


def learned_media(
    media: tuple[MediaInput, ...],
    prompt_len: int,
    expanded: int,
    expanded_ids: tuple[int, ...] = (),
) -> tuple[MediaInput, ...]:
    """``media`` with the token counts of images of unknown size filled in from the prefill's
    expanded prompt: each placeholder's run in ``expanded_ids`` when the images' positions are
    known, else the one unknown image from the expanded length (each image is one
    placeholder in ``prompt_len``)."""
    positions = [item.position for item in media]
    if expanded_ids and all(position is not None for position in positions):
        groups = image_runs([p for p in positions if p is not None], prompt_len, expanded_ids)
        filled = list(media)
        for members, total in groups or ():
            missing = [i for i in members if media[i].num_tokens is None]
            rest = total - sum(media[i].num_tokens or 0 for i in members)
            if len(missing) == 1 and rest > 0:
                filled[missing[0]] = msgspec.structs.replace(media[missing[0]], num_tokens=rest)
        return tuple(filled)
    unknown = [i for i, item in enumerate(media) if item.num_tokens is None]
    if len(unknown) != 1 or expanded <= 0:
        return media
    known = sum(item.num_tokens or 0 for item in media)
    count = expanded - (prompt_len - len(media)) - known
    if count < 1:
        return media
    filled = list(media)
    filled[unknown[0]] = msgspec.structs.replace(media[unknown[0]], num_tokens=count)
    return tuple(filled)
