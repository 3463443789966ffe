"""One vLLM frontend from start to close: wait for it, discover it, watch it, re-discover it.

Start waits for vLLM's health, discovers and validates the engine, sizes the router and the
admission pools from it, then keeps watching: readiness drops while vLLM is unhealthy, and on
recovery the engine is re-discovered and must still be the same model with the same layout
(a replaced instance with the same identity only reconfigures the router and admission).
What generation needs from the engine now served (its encoder, its ranks and their metadata)
is read from here per request and replaced as a whole on re-discovery.
"""

from __future__ import annotations

import asyncio
import logging

from rankgate.sidecar.admission import Admission
from rankgate.sidecar.channels import ChannelPool
from rankgate.sidecar.config import CONTROL_RPC_TIMEOUT_S, SidecarConfig
from rankgate.sidecar.convert import RequestEncoder
from rankgate.sidecar.discovery import Discovered, discover
from rankgate.sidecar.endpoint import parse_endpoint
from rankgate.sidecar.errors import DiscoveryError, EngineUnavailable, InvalidRequest
from rankgate.sidecar.health import HealthWatch, LeanProbe, wait_for_serving
from rankgate.sidecar.inference_client import GenerateRequest
from rankgate.sidecar.routing.base import Router
from rankgate.sidecar.types import PreparedRequest

log = logging.getLogger(__name__)

RANK_METADATA_KEY = "x-data-parallel-rank"

Metadata = tuple[tuple[str, str], ...]


def rank_metadata(rank: int) -> Metadata:
    """The gRPC metadata that pins a request to ``rank``."""
    return ((RANK_METADATA_KEY, str(rank)),)


class Lifecycle:
    """The connection to one vLLM frontend and what is known about the engine behind it."""

    def __init__(self, config: SidecarConfig, router: Router, admission: Admission) -> None:
        self._config = config
        self._router = router
        self._admission = admission
        # The ``engine`` policy leaves ranks to vLLM: one admission pool for the whole group.
        self._group = router.name == "engine"
        self.endpoint = parse_endpoint(config.endpoint)
        self.retry_after = max(1.0, config.health_interval)
        self.pool: ChannelPool | None = None
        self._watch: HealthWatch | None = None
        self._baseline: Discovered | None = None
        # The engine last discovered (kept while it is unhealthy).
        self.current: Discovered | None = None
        self.encoder: RequestEncoder | None = None
        self.rank_metadata: dict[int, Metadata] = {}
        self.ready = False
        self.closed = False
        self.problem = "the engine has not been discovered yet"
        self._kv_off_logged = False

    async def start(self) -> None:
        """Wait for vLLM, discover and validate it, configure and start the router, then watch.

        Raises DiscoveryError for an engine Rankgate must not serve and EngineUnavailable when
        the engine is not ready before ``startup_timeout``.
        """
        if self.pool is not None or self.closed:
            raise RuntimeError("Sidecar.start() may be called once")
        config = self._config
        self.pool = ChannelPool(
            self.endpoint, config.num_channels, config.tls_ca_file, self.retry_after
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.startup_timeout
        try:
            await wait_for_serving(self.pool.first.health, deadline, config.retry_interval)
            discovered = await self._discover_until(deadline)
            self._router.configure(discovered.info)
            self._admission.configure(discovered.info, self._group)
            await self._router.start()
        except BaseException:
            pool, self.pool = self.pool, None
            await pool.close()
            raise
        self._baseline = discovered
        self._activate(discovered)
        log.info(
            "serving %s (%s) from vLLM %s at %s: DP ranks %s, block size %d, router %s",
            discovered.info.served_model_name,
            discovered.info.model_id,
            discovered.info.engine_version,
            self.endpoint.target,
            list(discovered.info.ranks),
            discovered.info.block_size,
            self._router.name,
        )
        probe = LeanProbe(self.pool.first.inference, max(config.health_interval, 1.0))
        self._watch = HealthWatch(probe, config.health_interval, self._on_serving, self._on_down)
        self._watch.start()

    def begin_close(self) -> None:
        """Stop serving: nothing new is accepted from here on."""
        self.closed = True
        self.ready = False
        self.problem = "the gateway is shutting down"

    async def stop_watching(self) -> None:
        if self._watch is not None:
            await self._watch.close()

    async def close(self) -> None:
        """Stop the router and close the channels (after every stream has been dropped)."""
        if self.pool is not None:
            await self._router.close()
            await self.pool.close()

    def encode(self, request: PreparedRequest) -> list[GenerateRequest]:
        """The engine requests of every choice of ``request`` for the engine served now.

        Raises EngineUnavailable while nothing is served and InvalidRequest for a pinned rank
        that this frontend does not serve: the one check of a pin, made before admission (which
        keys its slots by rank) against the engine served now.
        """
        current = self.current
        encoder = self.encoder
        if not self.ready or current is None or encoder is None:
            raise self.unavailable()
        if request.rank is not None and request.rank not in current.info.ranks:
            raise InvalidRequest(
                f"data-parallel rank {request.rank} is not served here; "
                f"served ranks: {sorted(current.info.ranks)}"
            )
        return encoder.encode(request)

    def nudge(self) -> None:
        """Probe health now rather than at the next interval (a request saw the engine fail)."""
        if self._watch is not None:
            self._watch.nudge()

    def unavailable(self) -> EngineUnavailable:
        return EngineUnavailable(self.problem, self.retry_after)

    def shutdown_error(self) -> EngineUnavailable:
        return EngineUnavailable("the gateway is shutting down", self.retry_after)

    async def discover(self, rpc_timeout: float) -> Discovered:
        assert self.pool is not None
        stubs = self.pool.first
        return await discover(
            stubs.control,
            stubs.kv_transfer,
            self.endpoint.host,
            self._config.served_model_name,
            rpc_timeout,
        )

    async def _discover_until(self, deadline: float) -> Discovered:
        loop = asyncio.get_running_loop()
        while True:
            remaining = deadline - loop.time()
            try:
                return await self.discover(min(max(remaining, 0.1), CONTROL_RPC_TIMEOUT_S))
            except EngineUnavailable as error:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise EngineUnavailable(
                        f"engine not discovered before the startup deadline: {error.message}"
                    ) from None
                await asyncio.sleep(min(self._config.retry_interval, remaining))

    def _activate(self, discovered: Discovered) -> None:
        previous = self.current
        self.current = discovered
        if previous is None or previous.wire_model != discovered.wire_model:
            self.encoder = RequestEncoder(discovered.wire_model)
        if previous is None or previous.info.ranks != discovered.info.ranks:
            self.rank_metadata = {rank: rank_metadata(rank) for rank in discovered.info.ranks}
        if not discovered.info.kv_event_sources and not self._kv_off_logged:
            self._kv_off_logged = True
            log.info("vLLM advertises no KV-event sources: KV-aware routing is off")
        self.problem = ""
        self.ready = True

    def _on_down(self, reason: str) -> None:
        self.ready = False
        self.problem = f"the engine is unhealthy: {reason}"
        log.warning("vLLM is not serving (%s); requests get 503 until it recovers", reason)

    async def _on_serving(self) -> bool:
        """Re-discover; serve again only when the engine is still the one we started with."""
        assert self._baseline is not None
        try:
            discovered = await self.discover(CONTROL_RPC_TIMEOUT_S)
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
        current = self.current
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
            self._admission.configure(discovered.info, self._group)
        if not self.ready:
            log.info("vLLM is serving again")
        self._activate(discovered)
        return True

    def _set_problem(self, problem: str, level: int) -> None:
        self.ready = False
        if problem != self.problem:
            log.log(level, "%s", problem)
        self.problem = problem
