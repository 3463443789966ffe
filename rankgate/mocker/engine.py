"""One data-parallel rank: a continuous-batching scheduler over a paged, prefix-cached KV pool.

Each step schedules up to ``max_batched_tokens`` tokens across at most ``max_running_requests``
sequences (chunked prefill included), takes as long as the timing model says a GPU would, and
then emits one token per sequence whose inputs are all computed. Prefix-cache hits skip
prefill work, so they show up in TTFT; a bigger batch makes every step slower, so load shows
up in inter-token latency. Out of KV blocks, the newest request is preempted and recomputed
later, as vLLM does. Paced, every step instead lasts one fixed time on a clock the ranks
share: what a gateway sees from a GPU's batched decode, one token per running stream per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rankgate.mocker.cache import Block, ExtraKey, ExtraKeys, PrefixCache, block_hash
from rankgate.mocker.config import MockEngineConfig
from rankgate.mocker.events import KvEventPublisher
from rankgate.mocker.model import TokenModel
from rankgate.mocker.outbox import Outbox
from rankgate.mocker.output import Emitted, Finish, Sequence
from rankgate.mocker.request import MockRequest
from rankgate.mocker.status import ENGINE_DEAD, RpcStatus, internal
from rankgate.mocker.transfer import LEASE_ENDS_KEY, READ_NOTICE, issue, read_notice
from rankgate.mocker.vocab import Vocabulary

log = logging.getLogger(__name__)
# Mixed into a sampling context to give a decode that read released KV unrelated output.
GARBAGE_KEY = 0x5A17_C0DE_5EED


class State(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class EngineRequest:
    """Scheduler state of one request; ``tokens`` holds the prompt followed by the output."""

    req: MockRequest
    sequence: Sequence
    outbox: Outbox
    tokens: list[int]
    arrival: float
    state: State = State.WAITING
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    extra: list[ExtraKeys] = field(default_factory=list)
    num_computed: int = 0
    num_committed: int = 0
    cached_tokens: int = 0
    admitted: bool = False
    remote_prefill: bool = False
    first_token_at: float | None = None
    kv_transfer_out: dict[str, Any] | None = None
    # Pending while the remote prefill's KV is being pulled, before the request may schedule.
    transfer: asyncio.TimerHandle | None = None

    @property
    def request_id(self) -> str:
        return self.req.request_id


@dataclass(slots=True)
class RankCounters:
    """What tests read to prove which rank served what; plain ints, written by one thread."""

    requests_received: int = 0
    requests_served: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    aborts: int = 0
    preemptions: int = 0
    failed: int = 0
    stranded_transfers: int = 0
    transfers_completed: int = 0
    # Prefill side: KV held for a remote decode, freed when the decode read it, or at lease end.
    transfers_released: int = 0
    # Decode side: remote prefills whose KV was read after the prefill's lease ended.
    expired_reads: int = 0
    leases_expired: int = 0
    steps: int = 0
    # Seconds of modelled step time (at ``speed``): the share of wall time a rank was busy.
    busy_seconds: float = 0.0
    # The most requests running at once: at ``max_running_requests`` the rank was saturated,
    # and whatever arrived then waited for a slot.
    peak_running: int = 0


class RankEngine:
    """The scheduler loop of one DP rank; lives on the server's event loop."""

    def __init__(
        self,
        rank: int,
        config: MockEngineConfig,
        vocab: Vocabulary,
        model: TokenModel,
        publisher: KvEventPublisher | None,
    ) -> None:
        self.rank = rank
        self.config = config
        self.vocab = vocab
        self.model = model
        self.publisher = publisher
        self.cache = PrefixCache(config.blocks_per_rank, config.block_size)
        self.counters = RankCounters()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self.transferring: set[EngineRequest] = set()
        # The last prompts this rank accepted, so tests can see exactly what a client sent.
        self.recent_prompts: deque[tuple[str, list[int]]] = deque(maxlen=32)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dead: RpcStatus | None = None
        self._tick = 0  # the paced clock's last tick this rank stepped at
        self.die_after_tokens: int | None = None
        # Extra seconds every step takes (a fault: a zero-latency engine made slow at will).
        self.step_delay = 0.0
        # While set, a step waits here before it takes effect (a fault: requests held in place).
        self.step_gate: asyncio.Event | None = None
        self.on_death: Callable[[], None] | None = None
        self.withhold_transfer: Callable[[], bool] | None = None
        # Prefill side: finished requests' blocks kept for a decode engine to read, by id.
        self.held: dict[str, tuple[list[Block], asyncio.TimerHandle]] = {}
        self._side_channel: socket.socket | None = None
        self.side_channel_port = 0

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name=f"mock-rank-{self.rank}")
        if self.config.role != "decode":
            self._open_side_channel(loop)

    def _open_side_channel(self, loop: asyncio.AbstractEventLoop) -> None:
        """The NIXL-style side channel where decode engines say they have read a prefill's KV
        (UDP on loopback; ``kv_connector_port`` 0 picks a free port per rank)."""
        base = self.config.kv_connector_port
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((self.config.kv_connector_host, base + self.rank if base else 0))
        sock.setblocking(False)
        self.side_channel_port = int(sock.getsockname()[1])
        loop.add_reader(sock.fileno(), self._on_side_channel)
        self._side_channel = sock

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._side_channel is not None:
            asyncio.get_running_loop().remove_reader(self._side_channel.fileno())
            self._side_channel.close()
            self._side_channel = None
        for _, lease in self.held.values():
            lease.cancel()
        self.held.clear()

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def kill(self, error: RpcStatus | None = None) -> None:
        """Engine death: every in-flight request fails, new ones are refused."""
        self._dead = error or internal(ENGINE_DEAD)
        for request in list(self.requests.values()):
            self._drop(request)
            request.outbox.fail(self._dead)
            self.counters.failed += 1
        self._wakeup.set()
        if self.on_death is not None:
            self.on_death()

    def revive(self) -> None:
        self._dead = None

    # ---- load, as vLLM's DP balancer sees it ------------------------------------------------

    @property
    def load_score(self) -> int:
        return len(self.waiting) * 4 + len(self.running)

    @property
    def active(self) -> int:
        return len(self.requests)

    # ---- requests ----------------------------------------------------------------------------

    def submit(self, req: MockRequest) -> EngineRequest:
        if self._dead is not None:
            raise self._dead
        if req.request_id in self.requests:
            raise internal(f"request `{req.request_id}` is already in flight")
        request = EngineRequest(
            req=req,
            sequence=Sequence(req.spec, self.vocab, self.model),
            outbox=Outbox(),
            tokens=list(req.prompt),
            arrival=time.monotonic(),
        )
        params = req.kv_transfer_params or {}
        request.remote_prefill = bool(params.get("do_remote_prefill"))
        self.requests[req.request_id] = request
        self.recent_prompts.append((req.request_id, req.prompt))
        self.counters.requests_received += 1
        if req.spec.max_tokens == 0:
            self._finish(request, Emitted(-1, "", None, Finish.LENGTH, None, False), count=False)
            return request
        delay = self.config.transfer_seconds(len(req.prompt)) if request.remote_prefill else 0.0
        if delay > 0.0:
            self.transferring.add(request)
            request.transfer = asyncio.get_running_loop().call_later(
                delay, self._transferred, request
            )
            return request
        if request.remote_prefill:
            self._read_held(request, params)  # an instant transfer: read at once
        self._enqueue(request)
        return request

    def _transferred(self, request: EngineRequest) -> None:
        request.transfer = None
        self.transferring.discard(request)
        self.counters.transfers_completed += 1
        params = request.req.kv_transfer_params or {}
        self._read_held(request, params)
        self._enqueue(request)

    def _read_held(self, request: EngineRequest, params: dict[str, Any]) -> None:
        """Read the prefill's KV. After its lease the prefill engine may have handed the
        blocks to another request: vLLM's decode then answers from whatever they hold,
        without an error, and so does the mock (its output no longer follows the prompt)."""
        self._notify_read(params)
        ends = params.get(LEASE_ENDS_KEY)
        if isinstance(ends, (int, float)) and time.time() > ends:
            self.counters.expired_reads += 1
            spec = dataclasses.replace(
                request.req.spec, context_key=request.req.spec.context_key ^ GARBAGE_KEY
            )
            request.sequence = Sequence(spec, self.vocab, self.model)

    def _notify_read(self, params: dict[str, Any]) -> None:
        """Tell the prefill engine its KV was read so it frees it (NIXL's notification)."""
        notice = read_notice(params)
        if notice is None:
            return
        address, payload = notice
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
            sock.sendto(payload, address)

    def _on_side_channel(self) -> None:
        assert self._side_channel is not None
        while True:
            try:
                payload, _ = self._side_channel.recvfrom(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if payload.startswith(READ_NOTICE):
                self._release_held(payload[len(READ_NOTICE) :].decode(errors="replace"))

    def _hold(self, request: EngineRequest) -> None:
        """Keep a prefill's blocks for the decode engine until it reads them or the lease
        (``kv_lease_seconds``) runs out, as vLLM's NIXL connector does."""
        blocks, request.blocks = request.blocks, []
        lease = asyncio.get_running_loop().call_later(
            self.config.kv_lease_seconds, self._lease_expired, request.request_id
        )
        self.held[request.request_id] = (blocks, lease)

    def _release_held(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is None:
            log.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
                "decode worker. They may have expired.",
                request_id,
            )
            return
        blocks, lease = held
        lease.cancel()
        self.cache.release(blocks)
        self.counters.transfers_released += 1

    def _lease_expired(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is None:
            return
        log.warning(
            "Releasing expired KV blocks for request %s which were retrieved by 0 remote "
            "worker(s) before lease expired.",
            request_id,
        )
        self.cache.release(held[0])
        self.counters.leases_expired += 1

    def _enqueue(self, request: EngineRequest) -> None:
        self.waiting.append(request)
        self._wakeup.set()

    def abort(self, request_id: str) -> bool:
        """Abort by id (Control.Abort or a dropped stream); the stream ends with ABORTED."""
        request = self.requests.get(request_id)
        if request is None or request.state is State.FINISHED:
            return False
        if request.remote_prefill and request.first_token_at is None:
            self.counters.stranded_transfers += 1
        self.counters.aborts += 1
        self._finish(request, Emitted(-1, "", None, Finish.ABORTED, None, False), count=False)
        return True

    def reset_prefix_cache(self) -> None:
        self.cache.clear()
        self._publish()

    # ---- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        speed = self.config.rank_speed(self.rank)
        pace = self.config.paced_step_seconds
        loop = asyncio.get_running_loop()
        while True:
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self._dead is not None:
                await asyncio.sleep(0.01)
                continue
            batch, prefill_tokens = self._schedule()
            if pace > 0.0:
                # The next tick of the loop's clock, which every rank on this loop shares: a
                # request that arrives mid-step joins the next one, and a late step skips the
                # ticks it missed rather than bunching up to catch up. A timer may wake a
                # little before its tick, so the tick just stepped at never counts as next.
                now = loop.time()
                self._tick = max(self._tick + 1, int(now // pace) + 1)
                await asyncio.sleep(self._tick * pace - now)
            elif speed > 0.0:
                seconds = self._step_seconds(len(batch), prefill_tokens) / speed
                self.counters.busy_seconds += seconds
                await asyncio.sleep(seconds)
            else:
                await asyncio.sleep(0)
            if self.step_delay:
                await asyncio.sleep(self.step_delay)
            if self.step_gate is not None:
                await self.step_gate.wait()
            self._apply(batch)
            self._publish()

    def _step_seconds(self, sequences: int, prefill_tokens: int) -> float:
        if sequences == 0:
            return 0.001
        c = self.config
        return (
            c.decode_step_seconds
            + c.decode_seconds_per_sequence * sequences
            + c.prefill_seconds_per_token * prefill_tokens
        )

    def _schedule(self) -> tuple[list[tuple[EngineRequest, int]], int]:
        budget = self.config.max_batched_tokens
        batch: list[tuple[EngineRequest, int]] = []
        prefill = 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            take = min(len(request.tokens) - request.num_computed, budget)
            if not self._reserve(request, request.num_computed + take):
                if not self._preempt_for(request):
                    break
                continue
            batch.append((request, take))
            budget -= take
            prefill += take - 1
            index += 1
        while self.waiting and budget > 0:
            if len(self.running) >= self.config.max_running_requests:
                break
            request = self.waiting[0]
            if not self._admit(request):
                break
            self.waiting.popleft()
            request.state = State.RUNNING
            self.running.append(request)
            self.counters.peak_running = max(self.counters.peak_running, len(self.running))
            take = min(len(request.tokens) - request.num_computed, budget)
            if not self._reserve(request, request.num_computed + take):
                break
            batch.append((request, take))
            budget -= take
            prefill += take - 1
        return batch, prefill

    def _admit(self, request: EngineRequest) -> bool:
        """Match the prefix cache and take blocks for the first chunk; False if out of KV."""
        size = self.config.block_size
        total = len(request.tokens)
        self._extend_hashes(request, total // size)
        hits: list[Block] = []
        if request.remote_prefill and not request.admitted:
            cached = total - 1
        else:
            if not request.req.bypass_prefix_cache:
                limit = (total - 1) // size
                hits = self.cache.match(request.hashes[:limit])
            cached = len(hits) * size
        first_chunk = min(total - cached, self.config.max_batched_tokens)
        needed = -(-(cached + first_chunk) // size) - len(hits)
        if needed > self.cache.num_free - sum(1 for b in hits if b.ref == 0 and b.hash):
            return False
        self.cache.acquire(hits)
        fresh = self.cache.allocate(needed)
        if fresh is None:
            self.cache.release(hits)
            return False
        request.blocks = [*hits, *fresh]
        request.num_computed = cached
        request.num_committed = len(hits)
        if not request.admitted:
            request.admitted = True
            request.cached_tokens = len(hits) * size
            self.counters.prompt_tokens += len(request.req.prompt)
            self.counters.cached_tokens += request.cached_tokens
        return True

    def _reserve(self, request: EngineRequest, tokens: int) -> bool:
        needed = -(-tokens // self.config.block_size) - len(request.blocks)
        if needed <= 0:
            return True
        fresh = self.cache.allocate(needed)
        if fresh is None:
            return False
        request.blocks.extend(fresh)
        return True

    def _preempt_for(self, request: EngineRequest) -> bool:
        """Free the newest running request's blocks; False when it is ``request`` itself."""
        victim = self.running[-1]
        self._preempt(victim)
        return victim is not request

    def _preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self.cache.release(request.blocks)
        request.blocks = []
        request.num_computed = 0
        request.num_committed = 0
        request.state = State.WAITING
        self.waiting.appendleft(request)
        self.counters.preemptions += 1

    def _apply(self, batch: list[tuple[EngineRequest, int]]) -> None:
        self.counters.steps += 1
        now = time.monotonic()
        size = self.config.block_size
        for request, take in batch:
            if request.state is not State.RUNNING:
                continue
            request.num_computed += take
            if request.num_computed // size > request.num_committed:
                self._commit_full_blocks(request)
            if request.num_computed < len(request.tokens):
                continue
            emitted = request.sequence.next_token()
            request.tokens.append(emitted.token_id)
            self.counters.generated_tokens += 1
            if request.first_token_at is None:
                request.first_token_at = now
            if emitted.finish is Finish.NOT_FINISHED and len(request.tokens) >= (
                self.config.max_model_len
            ):
                emitted.text += request.sequence.finish_length()
                emitted.finish = Finish.LENGTH
            if emitted.finish is not Finish.NOT_FINISHED:
                self._finish(request, emitted, count=True)
            else:
                request.outbox.put(emitted)
            limit = self.die_after_tokens
            if limit is not None and request.sequence.num_tokens >= limit:
                self.die_after_tokens = None
                self.kill()
                return

    def _commit_full_blocks(self, request: EngineRequest) -> None:
        size = self.config.block_size
        full = min(request.num_computed // size, len(request.blocks))
        start = request.num_committed
        if full <= start:
            return
        self._extend_hashes(request, full)
        parent = request.hashes[start - 1] if start else None
        self.cache.commit(
            request.blocks[start:full],
            request.hashes[start:full],
            parent,
            request.tokens[start * size : full * size],
            request.extra[start:full],
            request.req.lora or None,
        )
        request.num_committed = full

    def _extend_hashes(self, request: EngineRequest, blocks: int) -> None:
        size = self.config.block_size
        req = request.req
        for index in range(len(request.hashes), blocks):
            start, end = index * size, (index + 1) * size
            keys: list[ExtraKey] = []
            if req.lora:
                keys.append(req.lora)
            keys.extend(
                (span.identifier, span.offset - start)
                for span in req.media
                if span.offset < end and span.offset + span.length > start
            )
            if index == 0 and req.cache_salt:
                keys.append(req.cache_salt)
            extra: ExtraKeys = tuple(keys) if keys else None
            parent = request.hashes[index - 1] if index else None
            request.hashes.append(block_hash(parent, request.tokens[start:end], extra))
            request.extra.append(extra)

    def _finish(self, request: EngineRequest, emitted: Emitted, *, count: bool) -> None:
        if count:
            self.counters.requests_served += 1
            params = request.req.kv_transfer_params or {}
            withhold = self.withhold_transfer
            if params.get("do_remote_decode") and not (withhold is not None and withhold()):
                emitted_params = self._transfer_params(request)
                request.kv_transfer_out = emitted_params
                self._hold(request)
        self._drop(request)
        request.outbox.put(emitted)

    def _drop(self, request: EngineRequest) -> None:
        if request.transfer is not None:
            request.transfer.cancel()
            request.transfer = None
            self.transferring.discard(request)
        if request.state is State.RUNNING:
            self.running.remove(request)
        elif request.state is State.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        request.state = State.FINISHED
        if request.blocks:
            self.cache.release(request.blocks)
            request.blocks = []
        self.requests.pop(request.request_id, None)

    def _transfer_params(self, request: EngineRequest) -> dict[str, Any]:
        c = self.config
        req = request.req
        # The fields and JSON types of vLLM 0.32's NixlConnector (block ids per KV group).
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[b.block_id for b in request.blocks]],
            "remote_engine_id": f"{c.instance_id or 'mock'}-dp{self.rank}",
            "remote_request_id": request.request_id,
            "remote_host": c.kv_connector_host,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(req.prompt),
            "transfer_mode": "pull",
            # The mock's own field (vLLM sends none): when the lease ends, so that a decode
            # engine reading later can answer from garbage, as vLLM's would.
            LEASE_ENDS_KEY: time.time() + c.kv_lease_seconds,
        }
        return issue(params, req.prompt, req.media, req.lora, req.cache_salt)

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)
