"""``grpc.health.v1`` probing: the startup wait and the watch that keeps readiness honest.

vLLM reports ``SERVING`` per service and flips to ``NOT_SERVING`` when its engine dies. A
server that answers ``NOT_FOUND``/``UNIMPLEMENTED`` is not a split-service vLLM at all, so the
startup wait fails fast on those instead of burning the whole deadline.

The startup wait probes through grpcio, as discovery then talks. The watch probes every second
for as long as the gateway runs, so it takes the lean connection the requests use
(:class:`LeanProbe`): a grpcio call wakes grpcio's own threads and its poller, and two probes
a second that way were half of an idle gateway's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2

from rankgate.sidecar.errors import DiscoveryError, EngineUnavailable, SidecarError
from rankgate.sidecar.status import Status

if TYPE_CHECKING:
    from rankgate.sidecar.inference_client import InferenceClient

log = logging.getLogger(__name__)

CONTROL = "vllm.Control"
INFERENCE = "vllm.Inference"
SERVICES = (CONTROL, INFERENCE)

_FATAL = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED})
# A probe that merely ran out of time says more about this machine's load than the engine's.
_SLOW = "DEADLINE_EXCEEDED"
_REQUESTS = {name: health_pb2.HealthCheckRequest(service=name) for name in SERVICES}
_SERVING = health_pb2.HealthCheckResponse.SERVING
_CHECK = "/grpc.health.v1.Health/Check"
_LEAN_FATAL = frozenset({Status.NOT_FOUND, Status.UNIMPLEMENTED})
_PARSE = health_pb2.HealthCheckResponse.FromString

# One service's probe: None when it is SERVING, else why not.
Probe = Callable[[str], Awaitable[str | None]]


class NotVllm(DiscoveryError):
    """The health service does not know vLLM's services: wrong server or wrong port."""


async def probe(health: Any, service: str, rpc_timeout: float) -> str | None:
    """None when ``service`` is SERVING, else why not. Raises NotVllm on NOT_FOUND/UNIMPLEMENTED."""
    request = _REQUESTS.get(service) or health_pb2.HealthCheckRequest(service=service)
    try:
        response = await health.Check(request, timeout=rpc_timeout)
    except grpc.aio.AioRpcError as error:
        if error.code() in _FATAL:
            raise _not_vllm(service, error.code().name) from None
        return _failed(service, error.code().name, error.details())
    return _verdict(service, response)


def _not_vllm(service: str, code: str) -> NotVllm:
    return NotVllm(
        f"health check for {service!r} answered {code}: "
        "the endpoint is not a vLLM gRPC server with split services"
    )


def _failed(service: str, code: str, details: str | None) -> str:
    return f"{service} health check failed ({code}: {details})"


def _verdict(service: str, response: health_pb2.HealthCheckResponse) -> str | None:
    if response.status != _SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return f"{service} is {status}"
    return None


class LeanProbe:
    """:func:`probe` over the lean HTTP/2 client of the Inference calls: the same answers,
    the same reasons (a probe out of time reads ``DEADLINE_EXCEEDED``), at a request's cost."""

    def __init__(self, client: InferenceClient, rpc_timeout: float) -> None:
        self._client = client
        self._timeout = rpc_timeout

    async def __call__(self, service: str) -> str | None:
        request = _REQUESTS.get(service) or health_pb2.HealthCheckRequest(service=service)
        call = self._client.unary(_CHECK, request, _PARSE)
        try:
            async with asyncio.timeout(self._timeout):
                response = await call
        except TimeoutError:
            call.cancel()
            return _failed(service, _SLOW, f"no answer in {self._timeout:g}s")
        except SidecarError as error:
            code = Status(error.grpc_status if error.grpc_status is not None else Status.UNKNOWN)
            if code in _LEAN_FATAL:
                raise _not_vllm(service, code.name) from None
            return _failed(service, code.name, error.message)
        except BaseException:
            call.cancel()  # the watch is closing: the engine need not answer
            raise
        return _verdict(service, response)


async def wait_for_serving(
    health: Any, deadline: float, retry_interval: float, services: Sequence[str] = SERVICES
) -> None:
    """Wait until every service is SERVING, in order, before the loop time ``deadline``."""
    loop = asyncio.get_running_loop()
    for service in services:
        reason = f"{service} was not probed"
        answered = False
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EngineUnavailable(f"engine not ready before the startup deadline: {reason}")
            attempt_timeout = min(remaining, max(retry_interval, 1.0))
            found = await probe(health, service, rpc_timeout=attempt_timeout)
            if found is None:
                break
            # The engine's own answer (NOT_SERVING, refused) says more than a probe that ran
            # out of time on a busy host, which is often the last one before the deadline.
            if _SLOW not in found or not answered:
                reason = found
                answered = _SLOW not in found
            log.debug("waiting for vLLM: %s", reason)
            await asyncio.sleep(min(retry_interval, max(deadline - loop.time(), 0.0)))


class HealthWatch:
    """Polls health every ``interval`` and reports transitions.

    ``on_serving`` runs when the engine is serving and either was not usable before or a
    verification is due (every ``verify_every`` polls, or right after :meth:`nudge`); it
    re-discovers and returns whether the engine may serve. ``on_down`` runs once per outage.
    Periodic verification catches restarts quicker than one poll interval, which health alone
    would miss. An explicit answer (NOT_SERVING, connection refused) counts at once; probes
    that only time out count after ``slow_misses`` in a row, so one stalled poll on a busy host
    does not turn every request away.
    """

    def __init__(
        self,
        probe: Probe,
        interval: float,
        on_serving: Callable[[], Awaitable[bool]],
        on_down: Callable[[str], None],
        verify_every: int = 10,
        slow_misses: int = 3,
    ) -> None:
        self._probe = probe
        self._interval = interval
        self._on_serving = on_serving
        self._on_down = on_down
        self._verify_every = verify_every
        self._slow_misses = slow_misses
        self._slow_streak = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.usable = True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rankgate-health-watch")

    def nudge(self) -> None:
        """Check and verify now: a stream just failed in a way that hints at a restart."""
        self._wake.set()

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        polls = 0
        while True:
            verify = self._wake.is_set() or polls % self._verify_every == self._verify_every - 1
            self._wake.clear()
            polls += 1
            try:
                await self._poll(verify)
            except asyncio.CancelledError:
                raise
            except Exception:  # the watch must outlive any single bad poll
                log.exception("health watch poll failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._wake.wait()

    async def _poll(self, verify: bool) -> None:
        reason: str | None = None
        for service in SERVICES:
            try:
                reason = await self._probe(service)
            except NotVllm as error:
                reason = error.message
            if reason is not None:
                break
        if reason is not None:
            if _SLOW in reason and self.usable:
                self._slow_streak += 1
                if self._slow_streak < self._slow_misses:
                    log.warning(
                        "health probe timed out (%d in a row): %s", self._slow_streak, reason
                    )
                    return
            self._slow_streak = 0
            if self.usable:
                self.usable = False
                self._on_down(reason)
            return
        self._slow_streak = 0
        if not self.usable or verify:
            self.usable = await self._on_serving()
