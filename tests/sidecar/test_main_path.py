"""The sidecar's main path on every engine under test: the mocker and real vLLM (DP=2).

Startup and discovery, a pinned generation whose blocks land on the pinned rank's KV-event
publisher only (with the tagged cache salt in the first block), OpenAI ``n``, a dropped
stream, and vLLM's own validation message reaching the caller as a typed error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.errors import InvalidRequest
from rankgate.sidecar.routing.hashing import SALT_TAG
from rankgate.sidecar.types import SamplingParams, StoppingParams
from tests.conformance.helpers import fresh_prompt, kv_listener
from tests.sidecar.fake_vllm import collect, request
from tests.sidecar.routers import FixedRouter
from tests.support.engines import EngineUnderTest

pytestmark = pytest.mark.timeout(300)


@pytest_asyncio.fixture
async def pinned(engine: EngineUnderTest) -> AsyncIterator[tuple[Sidecar, FixedRouter]]:
    router = FixedRouter(rank=1)
    sidecar = Sidecar(
        SidecarConfig(endpoint=engine.target, startup_timeout=60, health_interval=0.5), router
    )
    await sidecar.start()
    try:
        yield sidecar, router
    finally:
        await sidecar.close()


async def test_discovery(engine: EngineUnderTest, pinned: tuple[Sidecar, FixedRouter]) -> None:
    sidecar, router = pinned
    info = sidecar.info
    assert info.served_model_name == engine.served_model_name
    assert info.dp_size == engine.dp_size
    assert info.ranks == tuple(range(engine.dp_size))
    assert info.block_size == engine.block_size
    assert all(cap.kv_blocks > 0 and cap.max_running_requests > 0 for cap in info.capacity)
    assert [s.rank for s in info.kv_event_sources] == list(info.ranks)
    assert all("*" not in s.endpoint for s in info.kv_event_sources)
    assert router.configured == [info]


async def test_pinned_generation_lands_on_its_rank(
    engine: EngineUnderTest, pinned: tuple[Sidecar, FixedRouter]
) -> None:
    sidecar, router = pinned
    block = engine.block_size
    prompt = fresh_prompt(3 * block)
    with kv_listener(engine) as listener:
        deltas = await collect(
            sidecar.generate(
                request(
                    "main",
                    prompt_token_ids=tuple(prompt),
                    cache_salt="tenant-a",
                    stopping=StoppingParams(max_tokens=8, ignore_eos=True),
                )
            )
        )
        await asyncio.to_thread(
            listener.wait_for, lambda _: len(listener.stored(prompt)) >= 1, 60.0
        )
        await asyncio.to_thread(listener.pump, 1.0)
    assert deltas[0].prompt_tokens == len(prompt)
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 8
    assert sum(len(d.token_ids) for d in deltas) == 8
    assert "".join(d.text for d in deltas)
    stored = listener.stored(prompt)
    assert {event.port_rank for event in stored} == {1}
    first = stored[0]
    assert first.parent_block_hash is None
    assert first.extra_keys is not None
    assert SALT_TAG + "tenant-a" in str(first.extra_keys[0])
    assert (router.tickets[0].first_tokens, router.tickets[0].finishes) == (1, 1)
    assert sidecar.in_flight() == dict.fromkeys(sidecar.info.ranks, 0)


async def test_n_choices(pinned: tuple[Sidecar, FixedRouter]) -> None:
    sidecar, _ = pinned
    deltas = await collect(
        sidecar.generate(
            request(
                "n",
                prompt_token_ids=tuple(fresh_prompt(10)),
                n=2,
                sampling=SamplingParams(temperature=1.0, seed=7),
                stopping=StoppingParams(max_tokens=5, ignore_eos=True),
            )
        )
    )
    finals = {d.index: d for d in deltas if d.finish_reason}
    assert sorted(finals) == [0, 1]
    assert all(d.completion_tokens == 5 for d in finals.values())


async def test_dropped_stream_frees_the_engine(pinned: tuple[Sidecar, FixedRouter]) -> None:
    sidecar, _ = pinned
    stream = sidecar.generate(
        request(
            "drop",
            prompt_token_ids=tuple(fresh_prompt(10)),
            stopping=StoppingParams(max_tokens=400, ignore_eos=True),
        )
    )
    await anext(stream)
    await anext(stream)
    await stream.aclose()
    assert sidecar.in_flight() == dict.fromkeys(sidecar.info.ranks, 0)
    after = await collect(
        sidecar.generate(request("after", prompt_token_ids=tuple(fresh_prompt(10))))
    )
    assert after[-1].finish_reason is not None


async def test_engine_validation_is_a_typed_error(pinned: tuple[Sidecar, FixedRouter]) -> None:
    sidecar, _ = pinned
    with pytest.raises(InvalidRequest) as caught:
        await collect(sidecar.generate(request("bad", prompt_token_ids=(10**8,))))
    assert caught.value.message
    assert sidecar.ready
