"""``kv``, the default policy: KV-cache-aware and load-aware.

It prices each rank like Dynamo's KV router, in prompt-token units:
``prefill_weight * (uncached prompt tokens + queue_weight * prefill already queued there)
+ decode_weight * tokens held by its requests in decode
+ recent_weight * prompt tokens it prefilled lately`` (fading with ``recent_half_life``)
``+ share_weight * its recent requests beyond a fair share`` (fading with
``share_half_life``) ``+ copy_weight * the prompt tokens another rank holds that it would
compute again by evicting blocks of its full cache``, and takes the cheapest.

The copy term prices what a departure from the rank holding a prompt costs others: a warm
cache is full, so the copy evicts as many tokens of other prompts, computed again later by
whoever needs them. A rank with room for the copy pays nothing.

The recent-work term keeps a prefix that every prompt shares from herding each new
conversation onto one rank while the others look idle between turns
(``bench/peers_routing.py --real`` shows the busiest rank's share of prompt tokens).

The share term spreads a hot prefix. The rank that holds it answers its requests cheaply, so
it is sent more and more of them: under skewed traffic (a third of all sessions on one system
prompt) it would take two to ten times its share of the work at DP 8 to 32 and saturate while
the others idle. A fair share is the ranks' mean count of recent requests plus ``share_slack``
standard deviations (counts taken as Poisson), so chance and a handful of requests never count
as hot. A rank's surplus soon outweighs the system prompt's cold prefill elsewhere, so new
conversations open a second copy of the prefix, while a conversation whose long history is
cached stays put (``tests/routing/test_production_shape.py``, on the clock-free rank
simulation of ``tests/support/rank_sim.py``).

Dynamo weighs decode like prefill; here decode counts a tenth, because a running sequence
lengthens an engine step far less than prefilling its prompt did, and on the mocker's GPU-like
timing the tenth gave both the best hit rate and the best TTFT (``bench/routing_workload.py``).
Two guards keep the greedy choice honest: a rank at ``max_running_requests`` is skipped while
another has room, and a rank running ``hot_spill_requests`` more requests than the least busy
one is skipped. A rank with no admission slot left (``rankgate.sidecar.admission``) is never chosen
while another has one. Exact ties go to a rank picked by the prompt's first block key, so a
conversation's turns agree without always favouring rank 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from mypy_extensions import mypyc_attr

from rankgate.sidecar.routing.affinity import AffinityTable
from rankgate.sidecar.routing.base import PrefillCost, RouteTicket
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.hashing import KeyChain, prompt_chain
from rankgate.sidecar.routing.index import PredictedIndex
from rankgate.sidecar.routing.kv_view import KvView
from rankgate.sidecar.routing.load import RankPace, RecentWork
from rankgate.sidecar.routing.metrics import AFFINITY, SPILLS, RoutingMetrics
from rankgate.sidecar.routing.policies.ranked import RankedRouter, Topology, estimated
from rankgate.sidecar.routing.regret import RegretMeter, WatchedTicket
from rankgate.sidecar.types import EngineInfo, PreparedRequest

log = logging.getLogger(__name__)

# Blocks hashed before the decision first asks whether any rank holds the prompt's last one
# hashed so far; each further round hashes twice as many.
_FIRST_KEYS = 16


@mypyc_attr(allow_interpreted_subclasses=True)
class KvRouter(RankedRouter):
    """KV-cache-aware and load-aware: the policy this gateway exists for.

    With ``--workers`` only the first worker subscribes to the KV events; the others read its
    index's masks from shared memory (:mod:`rankgate.sidecar.routing.shared_index`).
    """

    name = "kv"

    def __init__(
        self,
        config: RoutingConfig,
        metrics: RoutingMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, metrics, clock)
        self.view = KvView(metrics, config.intake, config.index_file, config.index_max_age)
        self.predicted: PredictedIndex | None = None
        self.recent: RecentWork | None = None
        self.shares: RecentWork | None = None
        self.affinity: AffinityTable | None = None
        self.regret: RegretMeter | None = None
        self._affinity_followed = metrics.tally.outcome(AFFINITY, "followed")
        self._affinity_yielded = metrics.tally.outcome(AFFINITY, "yielded")
        self._last: tuple[PreparedRequest, KeyChain] | None = None
        # Routed prompts whose keys past the decision's are still to hash (see :meth:`sent`).
        self._unhashed: list[KeyChain] = []
        self._spill_hot = metrics.tally.outcome(SPILLS, "hot_prefix")
        self._spill_full = metrics.tally.outcome(SPILLS, "capacity")
        self._capacity: list[int] = []

    def _on_configure(self, info: EngineInfo, topology: Topology) -> None:
        self._last = None
        self.recent = (
            RecentWork(len(topology.ranks), self.config.recent_half_life, self.clock)
            if self.config.recent_weight > 0
            else None
        )
        self.shares = (
            RecentWork(len(topology.ranks), self.config.share_half_life, self.clock)
            if self.config.share_weight > 0
            else None
        )
        entries = self.config.affinity_entries
        self.affinity = (
            AffinityTable(entries, self.config.affinity_ttl, self.clock) if entries else None
        )
        config = self.config
        if config.pace_keep > 0:
            self.load.pace = RankPace(
                len(topology.ranks),
                self.clock,
                keep=config.pace_keep,
                offset=config.pace_offset_tokens,
                band=config.pace_band,
            )
        capacity = [max(1, blocks) for blocks in topology.device_blocks]
        self._capacity = capacity
        offload = [int(blocks * self.config.offload_index_factor) for blocks in capacity]
        meter = (
            RegretMeter(
                topology.ranks,
                topology.block_size,
                self.metrics,
                self.name,
                settle=self.config.regret_settle,
                max_keys=self.config.regret_keys,
                strikes=self.config.trust_strikes,
                interval=self.config.regret_interval,
                clock=self.clock,
            )
            if self.config.regret_keys and topology.sources
            else None
        )
        events = self.view.configure(
            topology.sources,
            self.slots,
            topology.block_size,
            capacity,
            offload,
            self.shared_load,
            meter,
            identity=f"{info.model_id}|{info.instance_id}|{topology.block_size}|{topology.ranks}",
        )
        # Only the worker running the intake hears the events the predictions are checked on.
        self.regret = meter if self.view.intake is not None else None
        if events:
            ttl = self.config.pending_ttl
        else:
            log.info("KV events are off: routing on load and on predictions from past routes")
            ttl = self.config.predict_ttl
        self.predicted = PredictedIndex(capacity, ttl, self.clock) if ttl > 0 else None

    def sent(self) -> None:
        """The routed request is on its way: the bookkeeping it left for now."""
        self._finish_keys()
        if self.predicted is not None:
            self.predicted.settle()
        if self.regret is not None:
            self.regret.register()

    async def start(self) -> None:
        await self.view.start()

    async def close(self) -> None:
        await self.view.close()

    def _index_sizes(self, slot: int) -> tuple[int, int, int]:
        predicted = self.predicted.size(slot) if self.predicted is not None else 0
        return (*self.view.sizes(slot), predicted)

    def chain(self, request: PreparedRequest) -> KeyChain:
        """The request's block keys, kept for all its choices."""
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
        chain = prompt_chain(
            request.prompt_token_ids,
            topology.block_size,
            salt=request.cache_salt,
            lora_name=request.lora_name,
            media=request.media,
            media_positions=positions,
        )
        self._last = (request, chain)
        return chain

    def _decision_keys(self, chain: KeyChain) -> list[int]:
        """The prompt's keys as far as the decision needs them: through the first block no
        rank is believed to hold, past which no match goes. A new 2k-token prompt is one
        round hashed instead of 128 blocks; the rest waits for :meth:`sent`.

        Rounds are whole multiples of the predictions' stride, so each ends on a checkpoint
        (:class:`~rankgate.sidecar.routing.index.PredictedIndex` keeps one key in ``stride``)."""
        hashes = chain.hashes
        view = self.view
        predicted = self.predicted
        stride = predicted.stride if predicted is not None else 1
        step = max(_FIRST_KEYS, stride) // stride * stride
        while len(hashes) < chain.blocks:
            if hashes:
                checkpoint = hashes[len(hashes) // stride * stride - 1]
                if not view.holds(hashes[-1]) and (
                    predicted is None or not predicted.holds(checkpoint)
                ):
                    break
            chain.extend(len(hashes) + step)
            step *= 2
        return hashes

    def _finish_keys(self) -> None:
        """Hash what routed prompts left unhashed, before anything reads their keys whole."""
        if self._unhashed:
            for chain in self._unhashed:
                chain.finish()
            self._unhashed = []

    def route(
        self, request: PreparedRequest, choice: int = 0, full: AbstractSet[int] = frozenset()
    ) -> RouteTicket:
        topology = self._require_topology()
        self.load.sync()
        self._finish_keys()
        chain = self.chain(request)
        hashes = self._decision_keys(chain)
        if not chain.finished:
            self._unhashed.append(chain)
        block = topology.block_size
        prompt_tokens = chain.prompt_tokens
        cached = self._cached_tokens(hashes, block, prompt_tokens)
        remembered = self._affinity(request, cached, block, prompt_tokens)
        # What the view believes each rank holds; a rank whose view is not trusted is routed
        # as if it held nothing, while its belief is still checked against its events.
        believed = cached
        regret = self.regret
        if regret is not None:
            regret.settle()
            if regret.untrusted:
                cached = cached.copy()
                for untrusted in regret.untrusted:
                    cached[untrusted] = 0
        slot = self._pinned_slot(request)
        reason = "pinned"
        if slot is None:
            slot, reason = self._choose(cached, prompt_tokens, hashes, full)
            if remembered is not None:
                if slot == remembered:
                    self._affinity_followed[0] += 1
                else:
                    self._affinity_yielded[0] += 1
        if request.affinity is not None and self.affinity is not None:
            self.affinity.record(request.affinity, slot, prompt_tokens)
        if self.predicted is not None:
            self.predicted.record(slot, hashes)
        if self.recent is not None:
            self.recent.add(slot, prompt_tokens - cached[slot])
        if self.shares is not None:
            self.shares.add(slot, 1.0)
        ticket = self._admit(
            slot, prompt_tokens, cached[slot], reason, estimated=estimated(request)
        )
        if regret is not None and regret.due(slot):
            predicted = believed[slot] // block
            found = self.view.match(hashes)
            by_events = min(found.any_tier[slot], predicted) if found is not None else 0
            watch = regret.watch(
                slot,
                hashes,
                predicted,
                (prompt_tokens - 1) // block,
                blocks=chain.blocks,
                lent=(by_events, predicted),
            )
            if watch is not None:
                return WatchedTicket(ticket, regret, watch)
        return ticket

    def prefill_cost(self, request: PreparedRequest) -> PrefillCost:
        """The rank where the uncached prompt plus the load already there is least."""
        topology = self._require_topology()
        chain = self.chain(request)
        total = chain.prompt_tokens
        cached = self._cached_tokens(self._decision_keys(chain), topology.block_size, total)
        hit, load = min(
            zip(cached, self.rank_loads(), strict=True), key=lambda pair: pair[1] - pair[0]
        )
        return PrefillCost(total - hit, load)

    def _affinity(
        self, request: PreparedRequest, cached: list[int], block: int, prompt_tokens: int
    ) -> int | None:
        """The slot the request's named conversation went to last, now believed to hold that
        request's prompt (as its KV events would say once published); None if unknown."""
        key = request.affinity
        if key is None or self.affinity is None:
            return None
        found = self.affinity.get(key)
        if found is None:
            return None
        slot, tokens = found
        if slot < len(cached):
            believed = min(tokens, prompt_tokens - 1) // block * block
            cached[slot] = max(cached[slot], believed)
        return slot

    def _cached_tokens(self, hashes: list[int], block: int, prompt_tokens: int) -> list[int]:
        slots = self.load.slots
        if not hashes:
            return [0] * slots
        # vLLM always computes a prompt's last token, even when every block is cached, and it
        # hits whole blocks only: a fully cached prompt recomputes its last block.
        limit = (prompt_tokens - 1) // block * block
        found = self.view.match(hashes)
        if self.predicted is None and found is not None and found.any_tier is found.device:
            # Events only, nothing offloaded: the device depths are the answer (the common
            # case, and the one a wide engine routes on every request).
            return [min(depth * block, limit) for depth in found.device]
        predicted = self.predicted.match(hashes) if self.predicted is not None else [0] * slots
        if found is None:
            depths = predicted
        elif found.any_tier is found.device:
            depths = [
                dev if dev >= pred else pred
                for dev, pred in zip(found.device, predicted, strict=True)
            ]
        else:
            weight = self.config.offloaded_hit_weight
            blocks = [
                max(dev, pred) + weight * max(0, tier - max(dev, pred))
                for dev, tier, pred in zip(found.device, found.any_tier, predicted, strict=True)
            ]
            return [min(int(b * block), limit) for b in blocks]
        most = limit // block
        return [(depth if depth < most else most) * block for depth in depths]

    def _price_copies(self, costs: list[float], cached: list[int], prompt_tokens: int) -> None:
        """Charge each rank for the tokens another rank holds that it would compute again by
        evicting blocks of its own: what that copy costs whoever needed them next."""
        held = max(cached)
        if held <= 0:
            return
        sizes = self.view.device_sizes()
        capacity = self._capacity
        if sizes is None or len(sizes) != len(costs) or len(capacity) != len(costs):
            return
        block = self._require_topology().block_size
        weight = self.config.copy_weight
        for slot, hit in enumerate(cached):
            copied = held - hit
            if copied > 0:
                evicted = prompt_tokens - hit - (capacity[slot] - sizes[slot]) * block
                if evicted > 0:
                    costs[slot] += weight * min(copied, evicted)

    def _choose(
        self,
        cached: list[int],
        prompt_tokens: int,
        hashes: list[int],
        full: AbstractSet[int] = frozenset(),
    ) -> tuple[int, str]:
        load = self.load
        config = self.config
        wp, wd, wq = config.prefill_weight, config.decode_weight, config.queue_weight
        if self.recent is not None:
            factor, raw = self.recent.scaled()
            wr = config.recent_weight * factor
            costs = [
                wp * (prompt_tokens - hit + wq * queued) + wd * decoding + wr * tokens
                for hit, queued, decoding, tokens in zip(
                    cached, load.prefill_tokens, load.decode_tokens, raw, strict=True
                )
            ]
        else:
            costs = [
                wp * (prompt_tokens - hit + wq * queued) + wd * decoding
                for hit, queued, decoding in zip(
                    cached, load.prefill_tokens, load.decode_tokens, strict=True
                )
            ]
        pace = load.pace
        speeds = pace.speeds() if pace is not None and pace.uneven else None
        if speeds is not None:
            # A slow rank's work is priced in time: the same tokens take it longer.
            costs = [cost / speed for cost, speed in zip(costs, speeds, strict=True)]
        if config.copy_weight > 0:
            self._price_copies(costs, cached, prompt_tokens)
        if self.shares is not None:
            factor, raw = self.shares.scaled()
            if speeds is not None:
                # Its fair share of requests shrinks with its speed.
                raw = [count / speed for count, speed in zip(raw, speeds, strict=True)]
            mean = sum(raw) * factor / len(raw)
            fair = (mean + config.share_slack * math.sqrt(mean)) / factor
            if max(raw) > fair:
                ws = config.share_weight * factor
                for slot, count in enumerate(raw):
                    if count > fair:
                        costs[slot] += ws * (count - fair)
        in_flight = load.in_flight
        room = self._with_room(full)
        ceiling = min([in_flight[slot] for slot in room]) + config.hot_spill_requests
        best_cost = min([costs[slot] for slot in room if in_flight[slot] <= ceiling])
        tied = [
            slot for slot in room if costs[slot] <= best_cost + 1e-9 and in_flight[slot] <= ceiling
        ]
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
                self._spill_full[0] += 1
            else:
                reason = "spill_hot"
                self._spill_hot[0] += 1
        return chosen, reason
