"""A consumer that sends a :class:`~rankgate.sidecar.DeltaSink` into ``Sidecar.generate``: the
choice's middle deltas reach it from the engine connection's callback, in order, while it is
ready; the first and the last are still yielded, and nothing is lost or doubled either way."""

from __future__ import annotations

from typing import Any

import pytest

from rankgate.sidecar.types import Delta, StoppingParams
from tests.sidecar.fake_vllm import request
from tests.sidecar.test_with_mocker import leaks, mock_engine, sidecar_on
from tests.support.cyclic_garbage import cyclic_garbage

TOKENS = 32


class Sink:
    def __init__(self, ready: bool = True, fail_at: int | None = None) -> None:
        self.taken: list[Delta] = []
        self.is_ready = ready
        self.fail_at = fail_at

    def ready(self) -> bool:
        return self.is_ready

    def put(self, delta: Delta) -> None:
        if self.fail_at is not None and len(self.taken) == self.fail_at:
            raise RuntimeError("the sink broke")
        self.taken.append(delta)


async def _read(sidecar: Any, sink: Sink, request_id: str) -> list[Delta]:
    """Every delta yielded, the sink sent in after the first."""
    stream = sidecar.generate(
        request(
            request_id,
            stream=True,
            stopping=StoppingParams(max_tokens=TOKENS, ignore_eos=True),
        )
    )
    yielded = [await anext(stream)]
    try:
        yielded.append(await stream.asend(sink))
        yielded.extend([delta async for delta in stream])
    finally:
        await stream.aclose()
    return yielded


async def test_middle_deltas_go_to_a_ready_sink_and_every_delta_arrives_once_in_order() -> None:
    with mock_engine(speed=0.5) as handle:
        async with sidecar_on(handle) as sidecar:
            ready = Sink()
            pushed = await _read(sidecar, ready, "ready")
            idle = Sink(ready=False)
            yielded = await _read(sidecar, idle, "idle")
        assert leaks(handle) == {0: (0, 0), 1: (0, 0)}
    # The first delta and the last are yielded; every one between went to the ready sink.
    assert len(pushed) == 2
    assert len(ready.taken) >= TOKENS // 2
    assert all(delta.finish_reason is None for delta in ready.taken)
    assert idle.taken == []
    for first, last in ((pushed[0], pushed[-1]), (yielded[0], yielded[-1])):
        assert first.prompt_tokens == 3
        assert last.finish_reason == "length"
    through_sink = [t for d in (pushed[0], *ready.taken, pushed[1]) for t in d.token_ids]
    through_task = [t for d in yielded for t in d.token_ids]
    assert len(through_task) == TOKENS
    assert through_sink == through_task


async def test_a_sink_that_fails_ends_the_stream_with_its_failure_and_the_engine_call() -> None:
    with mock_engine(speed=0.5) as handle:
        async with sidecar_on(handle) as sidecar:
            sink = Sink(fail_at=3)
            with pytest.raises(RuntimeError, match="the sink broke"):
                await _read(sidecar, sink, "broken")
            assert sidecar.in_flight() == {0: 0, 1: 0}
        assert leaks(handle) == {0: (0, 0), 1: (0, 0)}
    assert len(sink.taken) == 3


async def test_a_stream_read_through_a_sink_leaves_nothing_for_the_cyclic_collector() -> None:
    with mock_engine(speed=0.5) as handle:
        async with sidecar_on(handle) as sidecar:
            await _read(sidecar, Sink(), "warm")
            with cyclic_garbage("rankgate.sidecar") as left:
                for i in range(3):
                    sink = Sink()
                    await _read(sidecar, sink, f"pushed-{i}")
                    assert sink.taken
    assert not left
