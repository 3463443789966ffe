"""Where real vLLM, the gateway and the client run when a test or bench measures latency.

vLLM's CPU workers spin for about a second after every step (``SpinCondition.busy_loop_s``
in vLLM's ``shm_broadcast.py``). If they share cores with a gateway or a load generator, those
stall for whole seconds and a client's time to first token measures CPU starvation instead of
routing. The fair placement keeps vLLM (every DP engine) on one CPU and the gateway and client
on another, as they would sit beside a GPU. Hit-rate-only runs need none of this.

``RANKGATE_REAL_VLLM_PLACEMENT=shared`` turns the fair placement off for the tests, to show
what the latency property tests detect without it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

PLACEMENT_ENV = "RANKGATE_REAL_VLLM_PLACEMENT"


@dataclass(frozen=True)
class Placement:
    """CPUs for vLLM and for everything else (gateway, client); empty means "not pinned"."""

    engine: tuple[int, ...] = ()
    gateway: tuple[int, ...] = ()

    @property
    def pinned(self) -> bool:
        return bool(self.engine)

    @property
    def engine_cpus(self) -> str | None:
        """The ``scripts/real-vllm serve --cpus`` value, None when vLLM is not pinned."""
        return ",".join(map(str, self.engine)) if self.engine else None

    def describe(self) -> str:
        if not self.pinned:
            return "nothing pinned"
        return f"vLLM on CPU {self.engine_cpus}, gateway and client on CPU " + ",".join(
            map(str, self.gateway)
        )


SHARED = Placement()


def fair_placement() -> Placement:
    """vLLM on the first CPU this process may use, gateway and client on the second.

    Beyond two CPUs the rest stay unused rather than given to one side: the figures then mean
    the same on a larger machine as on the 2-core one they were designed for.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return SHARED
    return Placement(engine=(cpus[0],), gateway=(cpus[1],))


def placement_for_tests() -> Placement:
    """The tests' placement: fair unless ``RANKGATE_REAL_VLLM_PLACEMENT=shared``."""
    choice = os.environ.get(PLACEMENT_ENV, "fair")
    if choice == "shared":
        return SHARED
    if choice != "fair":
        raise ValueError(f"{PLACEMENT_ENV} is 'fair' or 'shared', not {choice!r}")
    return fair_placement()


@contextlib.contextmanager
def on_gateway_cpus(placement: Placement) -> Iterator[None]:
    """Run the calling thread (and the threads and processes it starts) on the gateway's CPUs.

    Linux applies affinity per thread, so only what this thread starts inside the block
    inherits it; the previous mask comes back afterwards.
    """
    if not placement.pinned:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, placement.gateway)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
