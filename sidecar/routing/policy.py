"""The routing policies and the factory the CLI calls: ``kv`` (default), ``load``,
``round_robin`` and ``engine``.

``kv`` prices each rank like Dynamo's KV router, in prompt-token units:
``prefill_weight * (uncached prompt tokens + prefill already queued there)
+ decode_weight * tokens held by its requests in decode
+ recent_weight * prompt tokens it prefilled lately`` (fading with ``recent_half_life``), and
takes the cheapest. The last term keeps a prefix that every prompt shares from herding each
new conversation onto one rank while the others look idle between turns
(``bench/peers_routing.py --real`` shows the busiest rank's share of prompt tokens). Dynamo
weighs decode like prefill; here decode counts a tenth, because a running sequence lengthens
an engine step far less than prefilling its prompt did, and on the mocker's GPU-like timing
the tenth gave both the best hit rate and the best TTFT (``bench/routing_workload.py``).
Two guards keep the greedy choice honest: a rank at ``max_running_requests`` is skipped while
another has room, and a rank running ``hot_spill_requests`` more requests than the least busy
one is skipped, so one hot prefix cannot pile every request onto one rank. A rank with no
admission slot left (``sidecar.admission``) is never chosen while another has one. Exact ties
go to a rank picked by the prompt's first block key, so a conversation's turns agree without
always favouring rank 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Literal

import msgspec
from prometheus_client import CollectorRegistry

from rankgate.sidecar.errors import EngineUnavailable, InvalidRequest
from rankgate.sidecar.routing.base import RouteDecision, Router, RouteTicket
from rankgate.sidecar.routing.events import IntakeSettings, KvEventIntake
from rankgate.sidecar.routing.hashing import PromptKeys, prompt_keys
from rankgate.sidecar.routing.index import (
    DEVICE,
    OFFLOADED,
    EventIndex,
    PredictedIndex,
    PrefixMatch,
)
from rankgate.sidecar.routing.load import LoadTracker, RecentWork, UntrackedTicket
from rankgate.sidecar.routing.metrics import (
    RankCounts,
    RankSnapshot,
    RoutingMetrics,
    routing_metrics,
)
from rankgate.sidecar.routing.shared_index import (
    MAX_SLOTS,
    SharedKvReader,
    SharedKvTable,
    table_name,
)
from rankgate.sidecar.routing.shared_index import remove as remove_table
from rankgate.sidecar.routing.shared_load import SharedLoadBoard
from rankgate.sidecar.types import EngineInfo, KvEventSource, PreparedRequest

log = logging.getLogger(__name__)

PolicyName = Literal["kv", "load", "round_robin", "engine"]
POLICIES: tuple[PolicyName, ...] = ("kv", "load", "round_robin", "engine")


class RoutingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Every routing tunable; validated once when built."""

    policy: PolicyName = "kv"
    # Cost weights, in prompt-token units (Dynamo's defaults: both 1; see the module doc).
    prefill_weight: float = 1.0
    decode_weight: float = 0.1
    # Share of a block's prefill an offloaded (CPU/disk) copy saves.
    offloaded_hit_weight: float = 0.5
    # In-flight requests a rank may run above the least busy one before it is skipped.
    hot_spill_requests: int = 8
    # Cost per prompt token a rank prefilled lately, fading by half every ``recent_half_life``
    # seconds (0: only what is in flight counts).
    recent_weight: float = 0.1
    recent_half_life: float = 2.0
    # Seconds a routed prompt is believed cached on its rank: without KV events, and while
    # waiting for the events of a prompt just routed (0: trust the events alone).
    predict_ttl: float = 120.0
    pending_ttl: float = 5.0
    # Offloaded-tier index entries allowed per rank, as a multiple of its device blocks.
    offload_index_factor: float = 4.0
    # The model's image placeholder token id, used to find each image in a token prompt when
    # the request does not give ``MediaInput.position``; with neither, prompts with images are
    # matched on none of their blocks.
    image_token_id: int | None = None
    intake: IntakeSettings = IntakeSettings()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from {POLICIES}")
        if self.prefill_weight < 0:
            raise ValueError("prefill_weight must be >= 0")
        if self.decode_weight < 0:
            raise ValueError("decode_weight must be >= 0")
        if not 0.0 <= self.offloaded_hit_weight <= 1.0:
            raise ValueError("offloaded_hit_weight must lie in [0, 1]")
        if self.hot_spill_requests < 1:
            raise ValueError("hot_spill_requests must be at least 1")
        if self.recent_weight < 0:
            raise ValueError("recent_weight must be >= 0")
        if self.recent_half_life <= 0:
            raise ValueError("recent_half_life must be positive")
        if self.predict_ttl <= 0:
            raise ValueError("predict_ttl must be positive")
        if self.pending_ttl < 0:
            raise ValueError("pending_ttl must be >= 0")
        if self.offload_index_factor < 0:
            raise ValueError("offload_index_factor must be >= 0")
        if self.image_token_id is not None and self.image_token_id < 0:
            raise ValueError("image_token_id must be >= 0")


def build_router(
    config: RoutingConfig,
    registry: CollectorRegistry | None = None,
    shared_load: SharedLoadBoard | None = None,
) -> Router:
    """The router for ``config.policy``; its metrics go to ``registry`` (default: global).

    ``shared_load`` is the board worker processes share their per-rank load through.
    """
    metrics = routing_metrics(registry)
    # Every tunable, once per router: what an operator's flags and environment amounted to.
    log.info("routing: %r", config)
    if config.policy == "engine":
        return EngineRouter(metrics)
    router: _CountingRouter
    if config.policy == "round_robin":
        router = RoundRobinRouter(config, metrics)
    elif config.policy == "load":
        router = LoadRouter(config, metrics)
    else:
        router = KvRouter(config, metrics)
    router.shared_load = shared_load
    return router


class EngineRouter:
    """Sends no rank: vLLM's own balancer chooses (the baseline that knows no caches)."""

    name = "engine"

    def __init__(self, metrics: RoutingMetrics) -> None:
        self._tally = metrics.tally
        self._unpinned = metrics.tally.bind("engine", "none").routed
        self._decision = RouteDecision(rank=None, policy="engine")

    def configure(self, info: EngineInfo) -> None:
        return None

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        if request.rank is not None:
            self._tally.count("engine", str(request.rank))
            return UntrackedTicket(
                RouteDecision(rank=request.rank, policy="engine", reason="pinned")
            )
        self._unpinned[0] += 1
        return UntrackedTicket(self._decision)

    def sent(self) -> None:
        return None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


class _Topology(msgspec.Struct, frozen=True):
    ranks: tuple[int, ...]
    block_size: int
    device_blocks: tuple[int, ...]
    max_running: tuple[int, ...]
    sources: tuple[KvEventSource, ...]


def _topology(info: EngineInfo) -> _Topology:
    by_rank = {cap.rank: cap for cap in info.capacity}
    device = tuple(by_rank[r].kv_blocks if r in by_rank else 0 for r in info.ranks)
    running = tuple(by_rank[r].max_running_requests if r in by_rank else 0 for r in info.ranks)
    return _Topology(info.ranks, info.block_size, device, running, info.kv_event_sources)


class _CountingRouter:
    """Shared by the policies that pick a rank: topology, load view, pins and metrics."""

    name: str = ""

    def __init__(self, config: RoutingConfig, metrics: RoutingMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.topology: _Topology | None = None
        self.slots: dict[int, int] = {}
        self.load = LoadTracker(())
        self.shared_load: SharedLoadBoard | None = None
        self._counts: list[RankCounts] = []
        self._rotation = 0

    def configure(self, info: EngineInfo) -> None:
        topology = _topology(info)
        if topology == self.topology:
            return
        self.topology = topology
        self.slots = {rank: slot for slot, rank in enumerate(topology.ranks)}
        self.load = LoadTracker(topology.max_running, self.shared_load, topology.ranks)
        self._counts = [self.metrics.tally.bind(self.name, str(rank)) for rank in topology.ranks]
        self._on_configure(info, topology)
        self.metrics.set_view(self.snapshot)

    def _on_configure(self, info: EngineInfo, topology: _Topology) -> None:
        return None

    def sent(self) -> None:
        return None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def snapshot(self) -> Iterator[RankSnapshot]:
        topology = self.topology
        if topology is None:
            return
        load = self.load
        load.sync()
        for slot, rank in enumerate(topology.ranks):
            device, offloaded, predicted = self._index_sizes(slot)
            yield RankSnapshot(
                rank=rank,
                device_blocks=device,
                offloaded_blocks=offloaded,
                predicted_blocks=predicted,
                in_flight=load.in_flight[slot],
                prefill_tokens=load.prefill_tokens[slot],
                decode_tokens=load.decode_tokens[slot],
            )

    def _index_sizes(self, slot: int) -> tuple[int, int, int]:
        return 0, 0, 0

    def _pinned_slot(self, request: PreparedRequest) -> int | None:
        if request.rank is None:
            return None
        slot = self.slots.get(request.rank)
        if slot is None:
            raise InvalidRequest(
                f"data-parallel rank {request.rank} is not served here; ranks: {list(self.slots)}"
            )
        return slot

    def _require_topology(self) -> _Topology:
        if self.topology is None:
            raise EngineUnavailable("the router has not been configured with an engine yet")
        return self.topology

    def _admit(
        self,
        slot: int,
        prompt_tokens: int,
        cached_tokens: int,
        reason: str,
        *,
        estimated: bool = False,
    ) -> RouteTicket:
        topology = self._require_topology()
        decision = RouteDecision(
            rank=topology.ranks[slot],
            cached_tokens=cached_tokens,
            prompt_tokens=prompt_tokens,
            policy=self.name,
            reason=reason,
            estimated=estimated,
        )
        counts = self._counts[slot]
        counts.routed[0] += 1
        counts.prompt[0] += prompt_tokens
        counts.cached[0] += cached_tokens
        if prompt_tokens:
            self.metrics.tally.ratio.observe(cached_tokens / prompt_tokens)
        return self.load.admit(slot, decision, prompt_tokens - cached_tokens, prompt_tokens)

    def _rotate(self, candidates: list[int]) -> int:
        self._rotation += 1
        return candidates[self._rotation % len(candidates)]

    def _with_room(self, full: AbstractSet[int] = frozenset()) -> list[int]:
        """Slots whose rank has an admission slot left (all of them when none has), those
        below ``max_running_requests`` first."""
        load = self.load
        if full and self.topology is not None:
            ranks = self.topology.ranks
            slots = [slot for slot in range(load.slots) if ranks[slot] not in full]
            if slots:
                return [slot for slot in slots if load.has_room(slot)] or slots
        room = [slot for slot in range(load.slots) if load.has_room(slot)]
        return room or list(range(load.slots))


def _estimated(request: PreparedRequest) -> bool:
    """Whether the prompt's length counts some image as one token, its size not yet known."""
    return any(item.num_tokens is None for item in request.media)


def _prompt_tokens(request: PreparedRequest) -> int:
    extra = sum(max((item.num_tokens or 1) - 1, 0) for item in request.media)
    return len(request.prompt_token_ids) + extra


class RoundRobinRouter(_CountingRouter):
    """Each rank in turn, blind to load and caches (a baseline)."""

    name = "round_robin"

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        topology = self._require_topology()
        slot = self._pinned_slot(request)
        reason = "pinned"
        if slot is None:
            count = len(topology.ranks)
            slot = self._rotation % count
            self._rotation += 1
            if full and len(full) < count:
                while topology.ranks[slot] in full:
                    slot = self._rotation % count
                    self._rotation += 1
            reason = "turn"
        return self._admit(slot, _prompt_tokens(request), 0, reason, estimated=_estimated(request))


class LoadRouter(_CountingRouter):
    """The cheapest rank by the ``kv`` cost with no cache knowledge (a baseline)."""

    name = "load"

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        self._require_topology()
        self.load.sync()
        prompt_tokens = _prompt_tokens(request)
        slot = self._pinned_slot(request)
        if slot is not None:
            return self._admit(slot, prompt_tokens, 0, "pinned", estimated=_estimated(request))
        load = self.load
        wp, wd = self.config.prefill_weight, self.config.decode_weight
        best: list[int] = []
        best_cost = 0.0
        for candidate in self._with_room(full):
            cost = wp * load.prefill_tokens[candidate] + wd * load.decode_tokens[candidate]
            cost += load.in_flight[candidate] * 1e-6
            if not best or cost < best_cost:
                best, best_cost = [candidate], cost
            elif cost == best_cost:
                best.append(candidate)
        return self._admit(
            self._rotate(best), prompt_tokens, 0, "least_loaded", estimated=_estimated(request)
        )


class KvRouter(_CountingRouter):
    """KV-cache-aware and load-aware: the policy this gateway exists for.

    With ``--workers`` only the first worker subscribes to the KV events; the others read its
    index's masks from shared memory (:mod:`sidecar.routing.shared_index`).
    """

    name = "kv"

    def __init__(self, config: RoutingConfig, metrics: RoutingMetrics) -> None:
        super().__init__(config, metrics)
        self.events: EventIndex | None = None
        self.intake: KvEventIntake | None = None
        # The first worker's table, which its index writes through to; the others' view of it.
        self.shared_table: SharedKvTable | None = None
        self.shared_reader: SharedKvReader | None = None
        # Tables whose intake is still stopping: removed once no intake can write to them.
        self._retired: list[SharedKvTable] = []
        self.predicted: PredictedIndex | None = None
        self.recent: RecentWork | None = None
        self._started = False
        self._stopping: list[KvEventIntake] = []
        self._last: tuple[PreparedRequest, PromptKeys] | None = None
        self._spill_hot = metrics.spills.labels("hot_prefix")
        self._spill_full = metrics.spills.labels("capacity")

    def _on_configure(self, info: EngineInfo, topology: _Topology) -> None:
        self._stopping = [intake for intake in self._stopping if intake.running]
        if self.intake is not None:
            self.intake.stop()
            self._stopping.append(self.intake)
            self.intake = None
        self.events = None
        self._close_shared()
        self._last = None
        self.recent = (
            RecentWork(len(topology.ranks), self.config.recent_half_life)
            if self.config.recent_weight > 0
            else None
        )
        capacity = [max(1, blocks) for blocks in topology.device_blocks]
        sources = topology.sources
        ttl = self.config.predict_ttl
        board = self.shared_load
        if board is not None and (board.workers < 2 or len(topology.ranks) > MAX_SLOTS):
            board = None
        if sources and board is not None and board.worker != 0:
            self.shared_reader = SharedKvReader(board, len(topology.ranks))
            ttl = self.config.pending_ttl
        elif sources:
            offload = [int(blocks * self.config.offload_index_factor) for blocks in capacity]
            if board is not None:
                remove_table(table_name(board, board.kv_generation))
                generation = board.kv_generation + 1
                self.shared_table = SharedKvTable.create(
                    table_name(board, generation), len(topology.ranks), sum(capacity) + sum(offload)
                )
                board.kv_generation = generation
            self.events = EventIndex(capacity, offload, self.shared_table)
            self.intake = KvEventIntake(
                sources,
                self.slots,
                self.events,
                topology.block_size,
                self.metrics,
                self.config.intake,
            )
            ttl = self.config.pending_ttl
            if self._started:
                self.intake.start()
        else:
            log.info("KV events are off: routing on load and on predictions from past routes")
        self.predicted = PredictedIndex(capacity, ttl) if ttl > 0 else None

    def sent(self) -> None:
        if self.predicted is not None:
            self.predicted.settle()

    async def start(self) -> None:
        self._started = True
        if self.intake is not None:
            self.intake.start()
            await asyncio.to_thread(self.intake.wait_subscribed, 5.0)

    async def close(self) -> None:
        self._started = False
        stopping = self._stopping
        self._stopping = []
        if self.intake is not None:
            stopping.append(self.intake)
            self.intake = None
        for intake in stopping:
            intake.stop()
        for intake in stopping:
            await asyncio.to_thread(intake.join, 5.0)
        self._close_shared()

    def _close_shared(self) -> None:
        """Let go of this worker's shared table or view; a table is removed only once no
        intake thread can write to it any more."""
        if self.shared_table is not None:
            # Readers drop it on their next look (a crashed writer's table is read until its
            # replacement makes the next one).
            if self.shared_load is not None:
                self.shared_load.kv_generation += 1
            self._retired.append(self.shared_table)
            self.shared_table = None
        if not any(intake.running for intake in self._stopping):
            for table in self._retired:
                table.close()
            self._retired = []
        if self.shared_reader is not None:
            self.shared_reader.close()
            self.shared_reader = None

    def _index_sizes(self, slot: int) -> tuple[int, int, int]:
        predicted = self.predicted.size(slot) if self.predicted is not None else 0
        events = self.events
        if events is not None:
            return events.size(slot), events.size(slot, OFFLOADED), predicted
        table = self.shared_reader.table() if self.shared_reader is not None else None
        if table is not None:
            return table.size(slot, DEVICE), table.size(slot, OFFLOADED), predicted
        return 0, 0, predicted

    def _event_match(self, hashes: list[int]) -> PrefixMatch | None:
        if self.events is not None:
            return self.events.match(hashes)
        table = self.shared_reader.table() if self.shared_reader is not None else None
        return table.match(hashes) if table is not None else None

    def keys(self, request: PreparedRequest) -> PromptKeys:
        """The request's block keys, computed once for all its choices."""
        last = self._last
        if last is not None and last[0] is request:
            return last[1]
        topology = self._require_topology()
        positions: list[int] | None = None
        media = request.media
        if media and all(item.position is not None for item in media):
            positions = [item.position for item in media if item.position is not None]
        elif media and self.config.image_token_id is not None:
            image = self.config.image_token_id
            positions = [i for i, token in enumerate(request.prompt_token_ids) if token == image]
        keys = prompt_keys(
            request.prompt_token_ids,
            topology.block_size,
            salt=request.cache_salt,
            lora_name=request.lora_name,
            media=request.media,
            media_positions=positions,
        )
        self._last = (request, keys)
        return keys

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        topology = self._require_topology()
        self.load.sync()
        keys = self.keys(request)
        hashes = keys.hashes
        block = topology.block_size
        prompt_tokens = keys.prompt_tokens
        cached = self._cached_tokens(hashes, block, prompt_tokens)
        slot = self._pinned_slot(request)
        reason = "pinned"
        if slot is None:
            slot, reason = self._choose(cached, prompt_tokens, hashes, full)
        if self.predicted is not None:
            self.predicted.record(slot, hashes)
        if self.recent is not None:
            self.recent.add(slot, prompt_tokens - cached[slot])
        return self._admit(slot, prompt_tokens, cached[slot], reason, estimated=_estimated(request))

    def _cached_tokens(self, hashes: list[int], block: int, prompt_tokens: int) -> list[int]:
        slots = self.load.slots
        if not hashes:
            return [0] * slots
        predicted = self.predicted.match(hashes) if self.predicted is not None else [0] * slots
        found = self._event_match(hashes)
        if found is None:
            blocks = [float(depth) for depth in predicted]
        else:
            weight = self.config.offloaded_hit_weight
            blocks = [
                max(dev, pred) + weight * max(0, tier - max(dev, pred))
                for dev, tier, pred in zip(found.device, found.any_tier, predicted, strict=True)
            ]
        # vLLM always computes a prompt's last token, even when every block is cached, and it
        # hits whole blocks only: a fully cached prompt recomputes its last block.
        limit = (prompt_tokens - 1) // block * block
        return [min(int(b * block), limit) for b in blocks]

    def _choose(
        self,
        cached: list[int],
        prompt_tokens: int,
        hashes: list[int],
        full: AbstractSet[int] = frozenset(),
    ) -> tuple[int, str]:
        load = self.load
        wp, wd = self.config.prefill_weight, self.config.decode_weight
        costs = [
            wp * (prompt_tokens - cached[slot] + load.prefill_tokens[slot])
            + wd * load.decode_tokens[slot]
            for slot in range(load.slots)
        ]
        if self.recent is not None:
            wr = self.config.recent_weight
            for slot, tokens in enumerate(self.recent.current()):
                costs[slot] += wr * tokens
        room = self._with_room(full)
        least = min(load.in_flight[slot] for slot in room)
        ceiling = least + self.config.hot_spill_requests
        eligible = [slot for slot in room if load.in_flight[slot] <= ceiling]
        best_cost = min(costs[slot] for slot in eligible)
        tied = [slot for slot in eligible if costs[slot] <= best_cost + 1e-9]
        if len(tied) == 1:
            chosen = tied[0]
        elif hashes:
            chosen = tied[hashes[0] % len(tied)]
        else:
            chosen = self._rotate(tied)
        reason = "best"
        overall = min(costs)
        if costs[chosen] > overall + 1e-9:
            if len(room) < load.slots and min(costs[slot] for slot in room) > overall + 1e-9:
                reason = "spill_capacity"
                self._spill_full.inc()
            else:
                reason = "spill_hot"
                self._spill_hot.inc()
        return chosen, reason
