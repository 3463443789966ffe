"""Faults on demand: the ways a real vLLM misbehaves, switched on by flags or by tests.

Everything here runs on the server's event loop; the test handle (``tests/support/mock_engine.py``)
forwards calls from other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from rankgate.mocker.engine import EngineRequest
from rankgate.mocker.group import DpGroup
from rankgate.mocker.request import MockRequest
from rankgate.mocker.status import resource_exhausted

SERVICES = ("", "vllm.Inference", "vllm.Control")
# vLLM main's split layout reports one more service.
SPLIT_SERVICES = (*SERVICES, "vllm.KvTransfer")
# A protobuf field tag with wire type 7, which no message may contain.
GARBLED = b"\xff" * 7
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(slots=True)
class Rejection:
    remaining: int
    message: str


class Faults:
    def __init__(
        self, group: DpGroup, health: HealthServicer, services: tuple[str, ...] = SERVICES
    ) -> None:
        self.services = services
        self._group = group
        self._health = health
        self._rejection: Rejection | None = None
        self._rank_rejections: dict[int, Rejection] = {}
        self._flapper: asyncio.Task[None] | None = None
        self._slow_start: asyncio.Task[None] | None = None
        self.serving = False
        self._death_task: asyncio.Task[None] | None = None
        self._withheld = 0
        self.garbled = 0
        for engine in group.engines.values():
            engine.on_death = self._on_death
            engine.withhold_transfer = self._withhold_transfer

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = SERVING if serving else NOT_SERVING
        for service in self.services:
            await self._health.set(service, status)

    # ---- slow start and flapping ------------------------------------------------------------

    async def slow_start(self, seconds: float) -> None:
        """Report NOT_SERVING for ``seconds`` (model loading), then SERVING."""
        await self.set_serving(False)
        if seconds <= 0:
            await self.set_serving(True)
            return
        self._slow_start = asyncio.get_running_loop().create_task(self._serve_after(seconds))

    async def _serve_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.set_serving(True)

    async def flap_health(self, period_s: float, count: int) -> None:
        """Toggle health ``count`` times, ``period_s`` apart, ending where it started."""
        await self._stop_flapping()
        self._flapper = asyncio.get_running_loop().create_task(self._flap(period_s, count))

    async def _flap(self, period_s: float, count: int) -> None:
        start = self.serving
        for _ in range(count):
            await asyncio.sleep(period_s)
            await self.set_serving(not self.serving)
        await self.set_serving(start)

    async def _stop_flapping(self) -> None:
        if self._flapper is not None:
            self._flapper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flapper
            self._flapper = None

    # ---- engine death ----------------------------------------------------------------------

    async def kill_engine(self) -> None:
        """All in-flight streams fail with INTERNAL; health turns NOT_SERVING."""
        for engine in self._group.engines.values():
            engine.kill()
        await self.set_serving(False)

    def slow_steps(self, seconds: float) -> None:
        """Make every engine step take ``seconds`` longer (0 restores the configured speed)."""
        for engine in self._group.engines.values():
            engine.step_delay = seconds

    def hold_steps(self) -> None:
        """Stop every engine before its next step takes effect, until :meth:`release_steps`:
        each request stays where it is, waiting or running, for as long as a test looks."""
        gate = asyncio.Event()
        for engine in self._group.engines.values():
            engine.step_gate = gate

    def release_steps(self) -> None:
        for engine in self._group.engines.values():
            gate, engine.step_gate = engine.step_gate, None
            if gate is not None:
                gate.set()

    def kill_after_tokens(self, tokens: int) -> None:
        """Die as soon as any request has produced ``tokens`` tokens (mid-stream death)."""
        for engine in self._group.engines.values():
            engine.die_after_tokens = tokens

    async def revive_engine(self) -> None:
        for engine in self._group.engines.values():
            engine.revive()
        await self.set_serving(True)

    def _on_death(self) -> None:
        """A rank died on its own (``kill_after_tokens``): health follows, as on vLLM."""
        if self.serving:
            self._death_task = asyncio.get_running_loop().create_task(self.set_serving(False))

    # ---- admission -------------------------------------------------------------------------

    def reject_requests(self, count: int = -1, message: str = "engine overloaded") -> None:
        """Refuse the next ``count`` requests (-1: all) with RESOURCE_EXHAUSTED."""
        self._rejection = Rejection(count, message) if count else None

    def check_admission(self) -> None:
        rejection = self._rejection
        if rejection is None:
            return
        if rejection.remaining > 0:
            rejection.remaining -= 1
            if rejection.remaining == 0:
                self._rejection = None
        raise resource_exhausted(rejection.message)

    def refuse_on_rank(self, rank: int, count: int = -1, message: str = "rank overloaded") -> None:
        """Refuse the next ``count`` requests (-1: all) that land on ``rank`` with
        RESOURCE_EXHAUSTED while the other ranks and health stay fine: a fault local to one
        rank, which a gateway may retry elsewhere. ``count`` 0 lifts it."""
        engine = self._group.engines[rank]
        self._rank_rejections[rank] = Rejection(count, message)
        if count == 0:
            del self._rank_rejections[rank]
        if "submit" in vars(engine):
            return
        submit = engine.submit

        def refusing(req: MockRequest) -> EngineRequest:
            rejection = self._rank_rejections.get(rank)
            if rejection is not None:
                if rejection.remaining > 0:
                    rejection.remaining -= 1
                    if rejection.remaining == 0:
                        del self._rank_rejections[rank]
                raise resource_exhausted(rejection.message)
            return submit(req)

        setattr(engine, "submit", refusing)  # noqa: B010 (shadowing a method on one instance)

    # ---- replies outside the contract --------------------------------------------------------

    def garble_replies(self, count: int = -1) -> None:
        """Answer the next ``count`` calls (-1: all; 0 lifts it) with a message that does not
        parse as a ``GenerateResponse``, as an engine with a corrupt serializer, or anything
        between it and the gateway, would."""
        self.garbled = count

    def garbled_reply(self) -> bytes | None:
        """The bytes to send instead of a call's next reply, while ``garble_replies`` holds."""
        if self.garbled == 0:
            return None
        if self.garbled > 0:
            self.garbled -= 1
        return GARBLED

    # ---- disaggregation ----------------------------------------------------------------------

    def withhold_transfer_params(self, count: int = 1) -> None:
        """The next ``count`` prefills (-1: all) finish without kv_transfer_params, like an
        engine started without a KV connector."""
        self._withheld = count

    def _withhold_transfer(self) -> bool:
        if self._withheld == 0:
            return False
        if self._withheld > 0:
            self._withheld -= 1
        return True

    # ---- KV events ---------------------------------------------------------------------------

    async def restart_kv_publisher(self, rank: int | None = None) -> None:
        for engine in self._group.engines.values():
            if engine.publisher is not None and rank in (None, engine.rank):
                await engine.publisher.restart()

    def drop_kv_batches(self, count: int, rank: int | None = None) -> None:
        for engine in self._group.engines.values():
            if engine.publisher is not None and rank in (None, engine.rank):
                engine.publisher.drop_next(count)

    def distort_kv_events(
        self,
        rank: int | None = None,
        *,
        silent: bool = False,
        lose_dropped: bool = False,
        block_size: int | None = None,
        token_offset: int = 0,
    ) -> None:
        """Make a rank's publisher go silent, lose what it drops past its replay buffer, or
        describe its blocks wrongly (another block size, shifted token ids); the defaults
        undo it."""
        for engine in self._group.engines.values():
            publisher = engine.publisher
            if publisher is not None and rank in (None, engine.rank):
                publisher.silent = silent
                publisher.forget_dropped = lose_dropped
                publisher.block_size_override = block_size
                publisher.token_offset = token_offset

    async def close(self) -> None:
        await self._stop_flapping()
        if self._slow_start is not None:
            self._slow_start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._slow_start
