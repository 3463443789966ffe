"""Unary generation on every engine under test (the mocker and real vLLM): the one reply is the
whole output the stream would have sent, and a consumer that leaves makes the engine stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.types import StoppingParams
from tests.conformance.helpers import fresh_prompt, kv_listener
from tests.conformance.test_abort import (
    MAX_MODEL_LEN,
    decoded_blocks_of_a_full_run,
    wait_until_quiet,
)
from tests.sidecar.fake_vllm import collect, request
from tests.sidecar.routers import FixedRouter
from tests.support.engines import EngineUnderTest

pytestmark = pytest.mark.timeout(300)

DROP_ATTEMPTS = 3


@pytest_asyncio.fixture
async def pinned(engine: EngineUnderTest) -> AsyncIterator[Sidecar]:
    sidecar = Sidecar(
        SidecarConfig(endpoint=engine.target, startup_timeout=60, health_interval=0.5),
        FixedRouter(rank=1),
    )
    await sidecar.start()
    try:
        yield sidecar
    finally:
        await sidecar.close()


async def test_the_reply_is_the_whole_streamed_output(pinned: Sidecar) -> None:
    prompt = tuple(fresh_prompt(12))
    stopping = StoppingParams(max_tokens=10, ignore_eos=True)
    streamed = await collect(
        pinned.generate(request("s", prompt_token_ids=prompt, stopping=stopping))
    )
    (whole,) = await collect(
        pinned.generate(request("u", prompt_token_ids=prompt, stopping=stopping, stream=False))
    )
    assert whole.token_ids == tuple(t for d in streamed for t in d.token_ids)
    assert whole.text == "".join(d.text for d in streamed)
    assert whole.prompt_tokens == len(prompt)
    assert whole.completion_tokens == 10
    assert whole.finish_reason == "length"
    assert whole.rank == 1


async def test_a_dropped_unary_call_stops_the_engine(
    engine: EngineUnderTest, pinned: Sidecar
) -> None:
    """Blocks stop being stored once the consumer leaves; only an abort can end this request
    (ignore_eos, limit at the context length) short of the full chain."""
    if engine.kind == "mock":
        pytest.skip(
            "the conformance mocker runs at zero latency and finishes before a client can "
            "leave; tests/sidecar/test_unary.py covers the mocker at a paced speed"
        )
    # A quiet machine can finish the whole run between the first decoded block and the
    # cancel; such a run says nothing about dropping, so a fresh prompt is tried.
    for _ in range(DROP_ATTEMPTS):
        prompt = fresh_prompt(engine.block_size)
        limit = MAX_MODEL_LEN - len(prompt)
        with kv_listener(engine) as listener:
            call = pinned.generate(
                request(
                    "unary-drop",
                    prompt_token_ids=tuple(prompt),
                    stopping=StoppingParams(max_tokens=limit, ignore_eos=True),
                    stream=False,
                )
            )
            task = asyncio.ensure_future(collect(call))
            await asyncio.to_thread(
                listener.wait_for, lambda _, p=prompt: bool(listener.stored(p)), 60.0
            )
            root = listener.stored(prompt)[0].block_hashes[-1]
            await asyncio.to_thread(
                listener.wait_for, lambda _, r=root: len(listener.chain(r)) >= 1, 60.0
            )
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            else:
                continue
            assert pinned.in_flight() == dict.fromkeys(pinned.info.ranks, 0)
            decoded = await asyncio.to_thread(wait_until_quiet, listener, root)
        assert decoded < decoded_blocks_of_a_full_run(engine)
        return
    pytest.fail(f"all {DROP_ATTEMPTS} runs finished before they could be dropped")
