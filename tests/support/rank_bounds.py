"""The conditions where a router can change latency, and the bounds every router is held to.

Operators meet three conditions daily where a router's choice, not the cold prefills of new
prompts, sets the first-token time: a rank slower than the rest (a throttled GPU, a noisy
neighbour), arrivals in waves, and caches smaller than the working set. :class:`Condition`
builds each on the rank simulation, calibrated as the friendly workload is: the session rate at
which round robin would keep every rank stepping ``load`` of the time, were all ranks as fast.

Two bounds frame every table. The floor (``EngineModel.floor``) is a request's least TTFT
under any router. The ceiling is the hit rate of the same trace replayed through one LRU cache
holding all the ranks' blocks pooled: what no placement across separate caches beats without
foreseeing the future.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

from rankgate.sidecar.routing.hashing import prompt_keys
from tests.support.rank_sim import EngineModel, full_rate, workload_plan
from tests.support.sessions import Bursts, Session, Shape


@dataclasses.dataclass(frozen=True)
class Condition:
    name: str
    # The speed factor of rank 0 (1: all ranks alike).
    slow: float = 1.0
    bursts: Bursts | None = None
    # Pooled KV as a fraction of the trace's working set (None: each rank's default).
    kv_fraction: float | None = None


CONDITIONS = {
    "friendly": Condition("friendly"),
    "slow": Condition("slow rank", slow=0.4),
    "bursts": Condition("on/off bursts", bursts=Bursts()),
    "small_kv": Condition("KV a quarter of the working set", kv_fraction=0.25),
}


@dataclasses.dataclass(frozen=True)
class Setting:
    model: EngineModel
    shape: Shape
    rate: float
    # Distinct prompt blocks of the friendly trace at this rate (what the ranks would hold).
    working_set: int


def working_set(plan: Sequence[Session], systems: Sequence[tuple[int, ...]], block: int) -> int:
    """Distinct full blocks of every prompt ``plan`` sends: each session's last prompt carries
    all its earlier ones."""
    keys: set[int] = set()
    for session in plan:
        last = session.prompt(systems, len(session.messages) - 1)
        keys.update(prompt_keys(last, block).hashes)
    return len(keys)


def setting(
    condition: Condition, dp: int, shape: Shape, load: float, seconds: float = 60.0
) -> Setting:
    """The engine, workload and session rate of ``condition`` at ``dp`` ranks and ``load``."""
    model = EngineModel(dp=dp)
    plan, systems = workload_plan(shape, full_rate(model, shape) * load, seconds, shape.seed + dp)
    ws = working_set(plan, systems, model.block_size)
    if condition.kv_fraction is not None:
        blocks = max(64, round(condition.kv_fraction * ws / dp))
        model = dataclasses.replace(model, kv_blocks=blocks)
    shape = dataclasses.replace(shape, bursts=condition.bursts)
    rate = full_rate(model, shape) * load
    if condition.slow != 1.0:
        model = dataclasses.replace(model, speeds=(condition.slow,))
    return Setting(model, shape, rate, ws)


def pooled_hit_rate(trace: Sequence[tuple[int, list[int]]], capacity: int, block: int) -> float:
    """The hit rate of ``trace`` (prompt length and block keys, in arrival order) through one
    LRU cache of ``capacity`` blocks: each prompt hits its leading cached blocks (never its
    last token, as vLLM computes it always), then all its blocks are the most recent."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for prompt, keys in trace:
        limit = (prompt - 1) // block
        depth = 0
        while depth < limit and depth < len(keys) and keys[depth] in cache:
            depth += 1
        hit += depth * block
        total += prompt
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total if total else 0.0
