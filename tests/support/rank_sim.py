"""A clock-free model of a data-parallel vLLM engine, driven through a real router.

Routing's properties under production-shaped traffic (a hot prefix spreads before its rank
saturates, no rank carries much more than its share) need minutes of traffic on many ranks to
show; on the live mock engine that is minutes of wall time and a noisy machine. Here simulated
time stands still while the router decides, so a minute of DP=16 traffic runs in seconds and
the same seed gives the same figures on any machine.

Each rank schedules as vLLM's scheduler and the mock engine do: FCFS, chunked prefill under a
token budget per step, a bounded number of running requests, a prefix cache of whole blocks
(less vLLM's null block) with LRU eviction of blocks no request holds; a step lasts the mock's
GPU-like timing (``rankgate/mocker/config.py``). Blocks stored and evicted reach the router's
KV-event index at the end of the step that made them, as the intake delivers vLLM's events; the
router's load view moves through its tickets (first token, finish), as on the live path.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from rankgate.sidecar.routing.base import RouteTicket
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.events import IntakeObserver
from rankgate.sidecar.routing.hashing import EMPTY_SEED, chain_hashes, prompt_keys
from rankgate.sidecar.routing.index import DEVICE, EventIndex
from rankgate.sidecar.routing.policies.kv import KvRouter
from rankgate.sidecar.types import (
    EngineInfo,
    KvEventSource,
    PreparedRequest,
    RankCapacity,
    SamplingParams,
    StoppingParams,
)
from tests.support.sessions import Session, Shape, sessions, system_prompts
from tests.support.sim_routers import FACTORIES, RouterFactory, kv_router

DEFAULTS = RoutingConfig()


@dataclasses.dataclass(frozen=True)
class EngineModel:
    dp: int = 4
    block_size: int = 16
    kv_blocks: int = 2048
    max_running: int = 64
    max_batched_tokens: int = 8192
    # The mock engine's timing at speed 1.0, divided by ``speed``.
    step_seconds: float = 8e-3
    sequence_seconds: float = 60e-6
    token_seconds: float = 50e-6
    speed: float = 0.5
    # Per rank, a factor on ``speed`` (a throttled GPU, a noisy neighbour); ranks past the
    # end run at 1.
    speeds: tuple[float, ...] = ()

    def rank_speed(self, slot: int) -> float:
        return self.speed * (self.speeds[slot] if slot < len(self.speeds) else 1.0)

    @property
    def fastest(self) -> float:
        return max(self.rank_speed(slot) for slot in range(self.dp))

    def floor(self, prompt: int, seen_blocks: int, speed: float | None = None) -> float:
        """A lower bound on a request's TTFT under any router: the fastest rank idle, holding
        every block an earlier request carried, and prefilling only the rest, alone (at
        ``speed``: on a rank of that speed instead)."""
        seen = min(seen_blocks, (prompt - 1) // self.block_size) * self.block_size
        novel = prompt - seen
        steps = -(-novel // self.max_batched_tokens)
        return (
            steps * (self.step_seconds + self.sequence_seconds) + self.token_seconds * novel
        ) / (speed if speed is not None else self.fastest)

    def info(self) -> EngineInfo:
        ranks = tuple(range(self.dp))
        return EngineInfo(
            model_id="sim",
            served_model_name="sim",
            aliases=(),
            engine_version="0.32.0",
            instance_id="sim",
            max_model_len=1 << 20,
            block_size=self.block_size,
            dp_size=self.dp,
            ranks=ranks,
            capacity=tuple(RankCapacity(r, self.kv_blocks, self.max_running) for r in ranks),
            max_batched_tokens=self.max_batched_tokens,
            supports_text_input=True,
            supports_lora=False,
            supports_multimodal=False,
            reasoning_parser="",
            tool_call_parser="",
            # Never subscribed to: the simulation writes the index itself.
            kv_event_sources=tuple(
                KvEventSource(r, f"tcp://127.0.0.1:{9 + r}", None, "") for r in ranks
            ),
        )


class _Request:
    __slots__ = (
        "arrived",
        "computed",
        "first_token",
        "floor",
        "generated",
        "held",
        "held_elsewhere",
        "keys",
        "on_done",
        "outputs",
        "private",
        "prompt",
        "recomputed",
        "recomputed_elsewhere",
        "seen",
        "slowed",
        "ticket",
    )

    def __init__(
        self,
        prompt: int,
        keys: list[int],
        outputs: int,
        ticket: RouteTicket,
        arrived: float,
        on_done: Callable[[_Request, float], None],
    ) -> None:
        self.prompt = prompt
        self.keys = keys
        self.outputs = outputs
        self.ticket = ticket
        self.arrived = arrived
        self.on_done = on_done
        self.computed = 0
        self.generated = 0
        self.first_token = math.nan
        # Leading blocks of its prompt that an earlier request carried; the least TTFT any
        # router could give it (``EngineModel.floor``); the seconds its rank spent
        # prefilling blocks of those it did not hold.
        self.seen = 0
        self.floor = 0.0
        # What its rank being slower than the fastest added to the floor.
        self.slowed = 0.0
        self.recomputed = 0.0
        # The most leading blocks any rank held when it was routed, and the seconds spent
        # prefilling again those of them its rank no longer held at admission: what a router
        # could have saved; the rest of ``recomputed`` was held nowhere, the caches' capacity.
        self.held_elsewhere = 0
        self.recomputed_elsewhere = 0.0
        # Keyed blocks this request holds a reference on, and blocks of its own.
        self.held: list[int] = []
        self.private = 0


class _Rank:
    def __init__(
        self,
        slot: int,
        model: EngineModel,
        index: EventIndex | None,
        observer: IntakeObserver | None = None,
    ) -> None:
        self.slot = slot
        self.model = model
        self.speed = model.rank_speed(slot)
        self.index = index
        # Hears the stores as the intake's observer does (the router's prediction check).
        self.observer = observer
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.refs: dict[int, int] = {}
        # Keyed blocks no request holds, least recently used first: what eviction takes.
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.private = 0
        self.stepping = False
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0
        self.busy_seconds = 0.0
        # The most requests it ever had waiting for admission, and waiting or running.
        self.deepest = 0
        self.crowded = 0

    @property
    def free(self) -> int:
        # One block is vLLM's null block, which never holds KV.
        return self.model.kv_blocks - 1 - len(self.refs) - self.private

    def _admit(self, request: _Request) -> bool:
        size = self.model.block_size
        limit = (request.prompt - 1) // size
        hits = self.depth(request.keys[:limit])
        needed = -(-(request.prompt + request.outputs) // size) - hits
        held = request.keys[:hits]
        idle = self.idle
        reclaimable = len(idle) - sum(map(idle.__contains__, held))
        if needed > self.free + reclaimable:
            return False
        refs = self.refs
        for key in held:
            count = refs[key]
            if count == 0:
                del idle[key]
            refs[key] = count + 1
        request.held = held
        self._take(needed)
        request.private = needed
        request.computed = hits * size
        carried = min(request.seen, limit)
        lost = max(0, carried - hits) * size
        request.recomputed = lost * self.model.token_seconds / self.speed
        elsewhere = max(0, min(request.held_elsewhere, carried) - hits) * size
        request.recomputed_elsewhere = elsewhere * self.model.token_seconds / self.speed
        self.prompt_tokens += request.prompt
        self.cached_tokens += hits * size
        self.requests += 1
        return True

    def depth(self, keys: Sequence[int]) -> int:
        """How many leading blocks of ``keys`` this rank holds."""
        return len(list(itertools.takewhile(self.refs.__contains__, keys)))

    def _hold(self, key: int) -> None:
        count = self.refs[key]
        if count == 0:
            del self.idle[key]
        self.refs[key] = count + 1

    def _take(self, blocks: int) -> None:
        while self.free < blocks:
            key, _ = self.idle.popitem(last=False)
            del self.refs[key]
            if self.index is not None:
                self.index.remove(self.slot, DEVICE, key)
            if self.observer is not None:
                self.observer.removed(self.slot, (key,))
        self.private += blocks

    def _store(self, request: _Request, upto: int) -> None:
        """Key the full prompt blocks computed up to token ``upto``: one event per new block."""
        size = self.model.block_size
        for position in range(len(request.held), min(upto // size, len(request.keys))):
            key = request.keys[position]
            if key in self.refs:
                # Computed twice (two requests prefilled it at once): the copy stays private.
                self._hold(key)
            else:
                self.refs[key] = 1
                self.private -= 1
                request.private -= 1
                if self.index is not None:
                    self.index.store(self.slot, DEVICE, key, key)
                if self.observer is not None:
                    self.observer.batch(self.slot, True)
                    self.observer.stored(self.slot, (key,))
            request.held.append(key)

    def _release(self, request: _Request) -> None:
        refs = self.refs
        idle = self.idle
        for key in request.held:
            count = refs[key] - 1
            refs[key] = count
            if count == 0:
                idle[key] = None
        self.private -= request.private
        request.held = []
        request.private = 0

    def schedule(self) -> tuple[list[tuple[_Request, int]], int]:
        budget = self.model.max_batched_tokens
        batch: list[tuple[_Request, int]] = []
        prefill = 0
        for request in self.running:
            if budget <= 0:
                break
            take = min(max(request.prompt - request.computed, 1), budget)
            batch.append((request, take))
            budget -= take
            prefill += take if request.computed < request.prompt else 0
        while self.waiting and budget > 0 and len(self.running) < self.model.max_running:
            request = self.waiting[0]
            if not self._admit(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            take = min(request.prompt - request.computed, budget)
            batch.append((request, take))
            budget -= take
            prefill += take
        return batch, prefill

    def duration(self, batch: Sequence[tuple[_Request, int]], prefill: int) -> float:
        m = self.model
        return (
            m.step_seconds + m.sequence_seconds * len(batch) + m.token_seconds * prefill
        ) / self.speed

    def apply(self, batch: Sequence[tuple[_Request, int]], now: float) -> None:
        for request, take in batch:
            if request.computed < request.prompt:
                request.computed += take
                self._store(request, request.computed)
                if request.computed < request.prompt:
                    continue
                request.first_token = now
                request.ticket.first_token()
            request.generated += 1
            if request.generated >= request.outputs:
                self.running.remove(request)
                self._release(request)
                request.ticket.finished()
                request.on_done(request, now)


@dataclasses.dataclass
class Outcome:
    ttfts: list[float] = dataclasses.field(default_factory=list)
    # Per request, beside its TTFT: the floor no router can beat, and the seconds spent
    # prefilling again blocks an earlier request had carried (misses on evicted blocks or
    # on another rank's). TTFT less both is the time it waited behind other work.
    floors: list[float] = dataclasses.field(default_factory=list)
    recomputed: list[float] = dataclasses.field(default_factory=list)
    # The part of ``recomputed`` some rank held when the request was routed.
    recomputed_elsewhere: list[float] = dataclasses.field(default_factory=list)
    # Per request: what its rank's slowness added to the floor, and the rank's slot.
    slowed: list[float] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    latencies: list[float] = dataclasses.field(default_factory=list)
    work: list[int] = dataclasses.field(default_factory=list)
    requests: list[int] = dataclasses.field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    seconds: float = 0.0
    # Per rank: the most requests it ever had waiting for admission, and waiting or running.
    deepest_queue: list[int] = dataclasses.field(default_factory=list)
    most_in_flight: list[int] = dataclasses.field(default_factory=list)
    # Per rank: the share of the time it was stepping, and its speed.
    busy: list[float] = dataclasses.field(default_factory=list)
    speeds: list[float] = dataclasses.field(default_factory=list)
    # Per request in arrival order: its prompt's length and block keys (the ceiling's trace).
    trace: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt if self.prompt else math.nan

    def _share(self, counts: Sequence[int]) -> float:
        """The busiest rank's count over its fair share, in proportion to its speed."""
        total = sum(counts)
        speeds = self.speeds or [1.0] * len(counts)
        pace = sum(speeds)
        if not total:
            return math.nan
        pairs = zip(counts, speeds, strict=True)
        return max(count * pace / (total * speed) for count, speed in pairs)

    @property
    def work_share(self) -> float:
        """The busiest rank's prefill work (uncached prompt tokens) over a fair share."""
        return self._share(self.work)

    @property
    def request_share(self) -> float:
        return self._share(self.requests)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttfts)


class Simulation:
    """One engine, one router, one workload; :meth:`run` plays it to the end."""

    def __init__(
        self,
        model: EngineModel,
        config: RoutingConfig = DEFAULTS,
        factory: RouterFactory = kv_router,
    ) -> None:
        self.model = model
        self.now = 0.0
        self.router = factory(config, lambda: self.now)
        self.router.configure(model.info())
        index = observer = None
        if isinstance(self.router, KvRouter):
            index, observer = self.router.view.events, self.router.regret
        self.ranks = [_Rank(slot, model, index, observer) for slot in range(model.dp)]
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._carried: set[int] = set()
        self.outcome = Outcome()

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def submit(
        self,
        tokens: tuple[int, ...],
        outputs: int,
        on_done: Callable[[_Request, float], None],
        keys: list[int] | None = None,
    ) -> None:
        """Route and queue one request; ``keys`` are its block keys when the caller has them."""
        request = PreparedRequest(
            request_id=f"sim-{next(self._order)}",
            prompt_token_ids=tokens,
            sampling=SamplingParams(temperature=0.0),
            stopping=StoppingParams(max_tokens=outputs),
        )
        ticket = self.router.route(request)
        self.router.sent()
        rank_id = ticket.decision.rank
        assert rank_id is not None
        if keys is None:
            keys = prompt_keys(tokens, self.model.block_size).hashes
        rank = self.ranks[rank_id]
        entry = _Request(len(tokens), keys, outputs, ticket, self.now, on_done)
        carried = self._carried
        entry.seen = len(list(itertools.takewhile(carried.__contains__, keys)))
        entry.floor = self.model.floor(entry.prompt, entry.seen)
        entry.slowed = self.model.floor(entry.prompt, entry.seen, rank.speed) - entry.floor
        self.outcome.trace.append((entry.prompt, keys))
        entry.held_elsewhere = max(other.depth(keys) for other in self.ranks)
        carried.update(keys)
        rank.waiting.append(entry)
        rank.deepest = max(rank.deepest, len(rank.waiting))
        rank.crowded = max(rank.crowded, len(rank.waiting) + len(rank.running))
        if not rank.stepping:
            self._step(rank)

    def _step(self, rank: _Rank) -> None:
        batch, prefill = rank.schedule()
        if not batch:
            rank.stepping = False
            return
        rank.stepping = True
        took = rank.duration(batch, prefill)
        rank.busy_seconds += took

        def done() -> None:
            rank.apply(batch, self.now)
            self._step(rank)

        self.at(self.now + took, done)

    def run(self, until: float = math.inf) -> None:
        events = self._events
        while events and events[0][0] <= until:
            when, _, action = heapq.heappop(events)
            self.now = when
            action()
        outcome = self.outcome
        outcome.deepest_queue = [rank.deepest for rank in self.ranks]
        outcome.most_in_flight = [rank.crowded for rank in self.ranks]
        outcome.seconds = self.now
        outcome.busy = [r.busy_seconds / self.now if self.now else 0.0 for r in self.ranks]
        outcome.speeds = [r.speed for r in self.ranks]
        outcome.work = [r.prompt_tokens - r.cached_tokens for r in self.ranks]
        outcome.requests = [r.requests for r in self.ranks]
        outcome.prompt = sum(r.prompt_tokens for r in self.ranks)
        outcome.cached = sum(r.cached_tokens for r in self.ranks)

    def play(self, plan: Sequence[Session], systems: Sequence[tuple[int, ...]]) -> None:
        """Queue every session of ``plan``: each turn goes once the previous one is answered
        and its pause is over."""
        for session in plan:
            self.at(session.start, self._turn(session, systems, 0, (), []))

    def _turn(
        self,
        session: Session,
        systems: Sequence[tuple[int, ...]],
        turn: int,
        before: tuple[int, ...],
        before_keys: list[int],
    ) -> Callable[[], None]:
        """Turn ``turn`` of ``session``, whose previous prompt was ``before``: each prompt
        extends the last, so only the new blocks are hashed."""
        size = self.model.block_size
        tokens: tuple[int, ...] = ()
        keys: list[int] = []

        def send() -> None:
            nonlocal tokens, keys
            if turn == 0:
                tokens = session.prompt(systems, 0)
            else:
                tokens = before + session.answers[turn - 1] + session.messages[turn]
            parent = before_keys[-1] if before_keys else EMPTY_SEED
            keys = before_keys + chain_hashes(tokens, size, parent, start=len(before_keys))
            self.submit(tokens, session.outputs[turn], finished, keys)

        def finished(request: _Request, now: float) -> None:
            self.outcome.ttfts.append(request.first_token - request.arrived)
            self.outcome.floors.append(request.floor)
            self.outcome.recomputed.append(request.recomputed)
            self.outcome.recomputed_elsewhere.append(request.recomputed_elsewhere)
            self.outcome.slowed.append(request.slowed)
            self.outcome.slots.append(request.ticket.decision.rank or 0)
            self.outcome.latencies.append(now - request.arrived)
            if turn + 1 < len(session.messages):
                follow = self._turn(session, systems, turn + 1, tokens, keys)
                self.at(now + session.pauses[turn], follow)

        return send


def full_rate(
    model: EngineModel, shape: Shape, seconds: float = 60.0, offered: bool = False
) -> float:
    """The session rate at which round robin would keep every rank stepping all the time:
    loads are fractions of it, so "70%" is a round-robin engine busy 70% of the time.

    With ``offered``, for sessions that outlast the arrival window (agent loops of a dozen
    turns), the busy time is counted against the window, not the run: the work the window's
    arrivals bring, per second of arrivals, which is the load they keep up in steady state.
    It is measured on one rank with this model's cache, where no router has a choice, and
    scaled by the ranks: the rate at which every rank would be busy serving its share as
    well as one rank alone serves it. The probe is then moved once to 70% of the estimate,
    since the work per session depends on how many run together."""
    if offered:
        # One rank: no routing choice, so the same for every router.
        one = dataclasses.replace(model, dp=1)
        probe = 0.05
        for _ in range(2):
            outcome = run_plan(one, "round_robin", shape, probe, seconds)
            busy = statistics.fmean(outcome.busy) * outcome.seconds / seconds
            full = probe / busy if busy else probe
            probe = 0.7 * full
        return full * model.dp
    probe = 0.5 * model.dp
    outcome = run_plan(model, "round_robin", shape, probe, seconds)
    busy = statistics.fmean(outcome.busy)
    return probe / busy if busy else probe


@functools.lru_cache(maxsize=8)
def workload_plan(
    shape: Shape, rate: float, seconds: float, seed: int
) -> tuple[tuple[Session, ...], tuple[tuple[int, ...], ...]]:
    """One workload, drawn once for every policy that plays it."""
    return tuple(sessions(shape, rate, seconds, seed)), tuple(system_prompts(shape))


def run_plan(
    model: EngineModel,
    policy: str,
    shape: Shape,
    rate: float,
    seconds: float,
    config: RoutingConfig = DEFAULTS,
) -> Outcome:
    """The outcome of the sessions that start in ``seconds`` at ``rate`` a second, routed by
    ``policy`` (a key of :data:`FACTORIES`) with ``config``'s tunables."""
    plan, systems = workload_plan(shape, rate, seconds, shape.seed + model.dp)
    sim = Simulation(model, config, FACTORIES[policy])
    sim.play(plan, systems)
    sim.run()
    return sim.outcome


def simulate(
    model: EngineModel,
    policy: str,
    shape: Shape,
    load: float,
    seconds: float,
    config: RoutingConfig = DEFAULTS,
    rate: float | None = None,
) -> Outcome:
    """The outcome of ``seconds`` of sessions at ``load`` times :func:`full_rate`."""
    full = rate if rate is not None else full_rate(model, shape)
    return run_plan(model, policy, shape, full * load, seconds, config)
