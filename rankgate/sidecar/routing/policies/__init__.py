"""The routing policies, one module each, and the factory the CLI calls.

``kv`` (the default, :mod:`.kv`) routes on the engines' KV caches and load; ``load``,
``round_robin`` and ``engine`` are the baselines it is measured against. A policy is a
:class:`~rankgate.sidecar.routing.base.Router`; those that pick a rank themselves share
:class:`.ranked.RankedRouter`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from rankgate.sidecar.routing.base import Router
from rankgate.sidecar.routing.config import PolicyName, RoutingConfig
from rankgate.sidecar.routing.metrics import RoutingMetrics, routing_metrics
from rankgate.sidecar.routing.policies.engine import EngineRouter
from rankgate.sidecar.routing.policies.kv import KvRouter
from rankgate.sidecar.routing.policies.load import LoadRouter
from rankgate.sidecar.routing.policies.ranked import RankedRouter
from rankgate.sidecar.routing.policies.round_robin import RoundRobinRouter
from rankgate.sidecar.routing.shared_load import SharedLoadBoard

log = logging.getLogger(__name__)

Clock = Callable[[], float]

RANKED: dict[PolicyName, Callable[[RoutingConfig, RoutingMetrics, Clock], RankedRouter]] = {
    "kv": KvRouter,
    "load": LoadRouter,
    "round_robin": RoundRobinRouter,
}


def compiled() -> bool:
    """Whether the route decision runs compiled (the optional mypyc build, ``setup.py``)."""
    module = sys.modules[KvRouter.__module__]
    return not str(module.__file__).endswith(".py")


def build_router(
    config: RoutingConfig,
    registry: CollectorRegistry | None = None,
    shared_load: SharedLoadBoard | None = None,
    clock: Clock = time.monotonic,
    side: str | None = None,
) -> Router:
    """The router for ``config.policy``; its metrics go to ``registry`` (default: global).

    ``shared_load`` is the board worker processes share their per-rank load through; ``clock``
    is what its decays and expiries read (tests give one they move by hand); ``side`` labels
    its metrics (one side of a disaggregated pair, in a registry made ``sided``).
    """
    metrics = routing_metrics(registry)
    if side is not None:
        metrics = metrics.for_side(side)
    # Every tunable, once per router: what an operator's flags and environment amounted to.
    log.info("routing (%s): %r", "compiled" if compiled() else "pure Python", config)
    if config.policy == "engine":
        return EngineRouter(metrics)
    router = RANKED[config.policy](config, metrics, clock)
    router.shared_load = shared_load
    return router


__all__ = [
    "EngineRouter",
    "KvRouter",
    "LoadRouter",
    "RoundRobinRouter",
    "build_router",
    "compiled",
]
