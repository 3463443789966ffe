"""A full rank's KV cache: how much it holds and which blocks it gives up first.

Routing under KV pressure (``bench/routing_simulation.py --kv-blocks``,
``bench/production_routing.py``) is measured on the mock engine, and the router's view of each
rank's cache is built from the BlockStored/BlockRemoved events. Both are only as good as the
mock's eviction is faithful to vLLM's, so these facts run on an engine with a small cache
(``SMALL_CACHE_BLOCKS`` a rank), mock and real:

- the capacity Control reports is the configured blocks, of which one per rank is vLLM's
  null block and never holds KV;
- a rank evicts only when a request needs more blocks than are free, and then exactly the
  shortfall;
- the least recently used prompt goes first, its last block first (vLLM frees a request's
  blocks tail first), so the head of a prompt outlives its tail;
- a prompt hit again moves to the back of the line, and a prompt whose tail was evicted is
  matched on its remaining head and recomputes only the tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import httpx
import pytest

from rankgate.wire.proto.vllm import control_pb2
from tests.conformance.helpers import (
    RPC_TIMEOUT_S,
    KvEventListener,
    control,
    fresh_prompt,
    kv_listener,
    make_request,
    stream,
)
from tests.conftest import SMALL_CACHE_BLOCKS
from tests.support.engines import EngineUnderTest

pytestmark = pytest.mark.timeout(300)

# Four full blocks and one token: five blocks while it runs, four cached once it is done.
PROMPT_BLOCKS = 4
# vLLM's block pool keeps one block per rank as its null block.
USABLE = SMALL_CACHE_BLOCKS - 1


@pytest.fixture
def channel(small_cache_engine: EngineUnderTest) -> Any:
    with grpc.insecure_channel(small_cache_engine.target) as opened:
        yield opened


def _empty_caches(engine: EngineUnderTest) -> None:
    """Every rank's prefix cache emptied, as vLLM's ``/reset_prefix_cache`` does."""
    if engine.mock is not None:
        for rank in engine.mock.ranks:
            engine.mock.call(engine.mock.engine(rank).reset_prefix_cache)
        return
    response = httpx.post(f"{engine.http_url}/reset_prefix_cache", timeout=30.0)
    response.raise_for_status()


def _prompt(engine: EngineUnderTest) -> list[int]:
    return fresh_prompt(PROMPT_BLOCKS * engine.block_size + 1)


def _send(channel: grpc.Channel, prompt: Sequence[int], rank: int = 0) -> None:
    stream(channel, make_request(prompt, max_new_tokens=1), rank=rank)


def _stored(listener: KvEventListener, prompt: Sequence[int]) -> list[int]:
    listener.wait_for(lambda _: listener.stored(prompt))
    return [key for event in listener.stored(prompt) for key in event.block_hashes]


def _removed(listener: KvEventListener, rank: int) -> list[int]:
    return [
        key
        for event in listener.events
        if event.kind == "BlockRemoved" and event.port_rank == rank
        for key in event.block_hashes
    ]


def test_the_reported_capacity_is_the_configured_blocks(
    channel: grpc.Channel, small_cache_engine: EngineUnderTest
) -> None:
    info = control(channel).GetServerInfo(control_pb2.GetServerInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info.total_kv_blocks == SMALL_CACHE_BLOCKS * small_cache_engine.dp_size


def test_a_full_rank_evicts_the_shortfall_oldest_prompt_first_tail_first(
    channel: grpc.Channel, small_cache_engine: EngineUnderTest
) -> None:
    engine = small_cache_engine
    _empty_caches(engine)
    prompts = [_prompt(engine) for _ in range(USABLE // PROMPT_BLOCKS + 5)]
    position: dict[int, tuple[int, int]] = {}
    with kv_listener(engine) as listener:
        for index, prompt in enumerate(prompts):
            _send(channel, prompt)
            stored = _stored(listener, prompt)
            assert len(stored) == PROMPT_BLOCKS
            position.update({key: (index, block) for block, key in enumerate(stored)})
            listener.pump(0.2)
            # The blocks it took beyond the free ones: its own five, on top of the four each
            # earlier prompt left cached.
            shortfall = max(0, PROMPT_BLOCKS * index + PROMPT_BLOCKS + 1 - USABLE)
            assert len(_removed(listener, 0)) == shortfall, f"after prompt {index}"
        removed = _removed(listener, 0)
        assert not _removed(listener, 1)
    assert removed, "the prompts never filled the rank"
    expected = [
        (index, block) for index in range(len(prompts)) for block in reversed(range(PROMPT_BLOCKS))
    ][: len(removed)]
    assert [position[key] for key in removed] == expected


def test_a_prompt_hit_again_outlives_older_ones_and_an_evicted_tail_is_recomputed(
    channel: grpc.Channel, small_cache_engine: EngineUnderTest
) -> None:
    engine = small_cache_engine
    _empty_caches(engine)
    # Leave room for exactly one more prompt without evicting, plus what the hit needs.
    kept = (USABLE - PROMPT_BLOCKS - 3) // PROMPT_BLOCKS
    first, second, *rest = [_prompt(engine) for _ in range(kept)]
    with kv_listener(engine) as listener:
        hashes = {}
        for prompt in (first, second, *rest):
            _send(channel, prompt)
            hashes[tuple(prompt)] = _stored(listener, prompt)
        stored_before = len(listener.stored(first))
        _send(channel, first)
        listener.pump(0.3)
        # A hit: nothing of the first prompt is stored again, and nothing was evicted.
        assert len(listener.stored(first)) == stored_before
        assert not _removed(listener, 0)
        # Fill past the capacity until something goes.
        while not _removed(listener, 0):
            _send(channel, _prompt(engine))
            listener.pump(0.3)
        removed = _removed(listener, 0)
        assert set(removed) <= set(hashes[tuple(second)])
        assert removed == list(reversed(hashes[tuple(second)]))[: len(removed)]
        assert len(removed) < PROMPT_BLOCKS
        # The second prompt again: its head still cached, its tail stored anew with the same
        # identity, nothing else.
        before = {id(event) for event in listener.stored(second)}
        _send(channel, second)
        listener.wait_for(
            lambda _: any(id(event) not in before for event in listener.stored(second))
        )
        listener.pump(0.3)
        again = [
            key
            for event in listener.stored(second)
            if id(event) not in before
            for key in event.block_hashes
        ]
        assert again == hashes[tuple(second)][PROMPT_BLOCKS - len(removed) :]
