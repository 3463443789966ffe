"""What every policy that picks a rank itself shares: the engine's topology, the load view,
client pins and the routing metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet

import msgspec
from mypy_extensions import mypyc_attr

from rankgate.sidecar.errors import EngineUnavailable
from rankgate.sidecar.routing.base import PrefillCost, RouteDecision, RouteTicket
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.load import LoadTracker
from rankgate.sidecar.routing.metrics import RankCounts, RankSnapshot, RoutingMetrics
from rankgate.sidecar.routing.shared_load import SharedLoadBoard
from rankgate.sidecar.types import EngineInfo, KvEventSource, PreparedRequest


class Topology(msgspec.Struct, frozen=True):
    ranks: tuple[int, ...]
    block_size: int
    device_blocks: tuple[int, ...]
    max_running: tuple[int, ...]
    sources: tuple[KvEventSource, ...]


def topology_of(info: EngineInfo) -> Topology:
    by_rank = {cap.rank: cap for cap in info.capacity}
    device = tuple(by_rank[r].kv_blocks if r in by_rank else 0 for r in info.ranks)
    running = tuple(by_rank[r].max_running_requests if r in by_rank else 0 for r in info.ranks)
    return Topology(info.ranks, info.block_size, device, running, info.kv_event_sources)


@mypyc_attr(allow_interpreted_subclasses=True)
class RankedRouter:
    """Shared by the policies that pick a rank: topology, load view, pins and metrics."""

    name: str = ""

    def __init__(
        self,
        config: RoutingConfig,
        metrics: RoutingMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # What "lately" and "expired" are measured on (a simulation brings its own).
        self.clock = clock
        self.config = config
        self.metrics = metrics
        self.topology: Topology | None = None
        self.slots: dict[int, int] = {}
        self.load = LoadTracker(())
        self.shared_load: SharedLoadBoard | None = None
        self._counts: list[RankCounts] = []
        self._rotation = 0

    def configure(self, info: EngineInfo) -> None:
        topology = topology_of(info)
        if topology == self.topology:
            return
        self.topology = topology
        self.slots = {rank: slot for slot, rank in enumerate(topology.ranks)}
        self.load = LoadTracker(topology.max_running, self.shared_load, topology.ranks)
        self._counts = [self.metrics.tally.bind(self.name, str(rank)) for rank in topology.ranks]
        self._on_configure(info, topology)
        self.metrics.set_view(self.snapshot)

    def _on_configure(self, info: EngineInfo, topology: Topology) -> None:
        return None

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        raise NotImplementedError

    def prefill_cost(self, request: PreparedRequest) -> PrefillCost:
        """The whole prompt (no cache view), on the least loaded rank."""
        loads = self.rank_loads()
        return PrefillCost(prompt_tokens(request), min(loads) if loads else 0.0)

    def rank_loads(self) -> list[float]:
        """Each slot's load in prompt tokens, weighed as the route weighs it: queued prefill
        (``queue_weight``) and running sequences (``decode_weight`` per prefill weight)."""
        load = self.load
        load.sync()
        config = self.config
        wq, wd = config.queue_weight, config.decode_weight / config.prefill_weight
        return [
            wq * queued + wd * decoding
            for queued, decoding in zip(load.prefill_tokens, load.decode_tokens, strict=True)
        ]

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
        pace = load.pace
        for slot, rank in enumerate(topology.ranks):
            device, offloaded, predicted = self._index_sizes(slot)
            queued = load.prefill_tokens[slot]
            yield RankSnapshot(
                speed=pace.speeds()[slot] if pace is not None else 1.0,
                predicted_wait=pace.wait(slot, queued) if pace is not None else 0.0,
                rank=rank,
                device_blocks=device,
                offloaded_blocks=offloaded,
                predicted_blocks=predicted,
                in_flight=load.in_flight[slot],
                prefill_tokens=queued,
                decode_tokens=load.decode_tokens[slot],
            )

    def _index_sizes(self, slot: int) -> tuple[int, int, int]:
        return 0, 0, 0

    def _pinned_slot(self, request: PreparedRequest) -> int | None:
        if request.rank is None:
            return None
        slot = self.slots.get(request.rank)
        if slot is None:
            # The sidecar checked the pin before admission; the engine's ranks changed since.
            raise EngineUnavailable("the engine's data-parallel ranks changed; retry")
        return slot

    def _require_topology(self) -> Topology:
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
        speed = wait = 0.0
        pace = self.load.pace
        if pace is not None:
            speed = pace.speeds()[slot]
            wait = pace.wait(slot, self.load.prefill_tokens[slot])
        decision = RouteDecision(
            rank=topology.ranks[slot],
            cached_tokens=cached_tokens,
            prompt_tokens=prompt_tokens,
            policy=self.name,
            reason=reason,
            estimated=estimated,
            speed=speed or 1.0,
            wait=wait,
        )
        counts = self._counts[slot]
        counts.routed[0] += 1
        counts.prompt[0] += prompt_tokens
        counts.cached[0] += cached_tokens
        if prompt_tokens:
            self.metrics.tally.ratio.observe(cached_tokens / prompt_tokens)
        cap = self.config.decode_tokens_cap
        held = min(prompt_tokens, cap) if cap else prompt_tokens
        return self.load.admit(slot, decision, prompt_tokens - cached_tokens, held)

    def _rotate(self, candidates: list[int]) -> int:
        self._rotation += 1
        return candidates[self._rotation % len(candidates)]

    def _with_room(self, full: AbstractSet[int] = frozenset()) -> list[int]:
        """Slots whose rank has an admission slot left (all of them when none has), those
        below ``max_running_requests`` first."""
        load = self.load
        room = load.below_max()
        if full and self.topology is not None:
            ranks = self.topology.ranks
            slots = [slot for slot in range(load.slots) if ranks[slot] not in full]
            if slots:
                return [slot for slot in room if ranks[slot] not in full] or slots
        return room or list(range(load.slots))


def estimated(request: PreparedRequest) -> bool:
    """Whether the prompt's length counts some image as one token, its size not yet known."""
    return any(item.num_tokens is None for item in request.media)


def prompt_tokens(request: PreparedRequest) -> int:
    extra = sum(max((item.num_tokens or 1) - 1, 0) for item in request.media)
    return len(request.prompt_token_ids) + extra
