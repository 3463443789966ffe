"""`x-data-parallel-rank` pins a request to a rank, proven by which publisher stores its blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance.helpers import (
    KvEventListener,
    fresh_prompt,
    kv_listener,
    make_request,
    rpc_error,
    stream,
    unary,
)
from tests.support.engines import EngineUnderTest

pytestmark = pytest.mark.timeout(120)

PROMPT_BLOCKS = 4
# After the wanted events arrive, how long a stray event on another rank gets to show up.
STRAY_WINDOW_S = 1.0
PARSE_ERROR = "x-data-parallel-rank metadata must be an unsigned 32-bit integer"
CALLS: dict[str, Callable[[grpc.Channel, inference_pb2.GenerateRequest, str], Any]] = {
    "stream": lambda channel, request, rank: stream(channel, request, rank=rank),
    "unary": lambda channel, request, rank: unary(channel, request, rank=rank),
}


def stored_tokens(listener: KvEventListener, prompt: list[int]) -> tuple[int, ...]:
    return tuple(token for event in listener.stored(prompt) for token in event.token_ids)


@pytest.mark.parametrize("rank", [0, 1])
def test_pinned_request_stores_blocks_on_that_rank_only(
    engine_channel: grpc.Channel, engine: EngineUnderTest, rank: int
) -> None:
    block = engine.block_size
    prompt = fresh_prompt(PROMPT_BLOCKS * block + 5)
    full_blocks = tuple(prompt[: PROMPT_BLOCKS * block])
    with kv_listener(engine) as listener:
        stream(engine_channel, make_request(prompt, max_new_tokens=2), rank=rank)
        listener.wait_for(lambda _: stored_tokens(listener, prompt) == full_blocks)
        listener.pump(STRAY_WINDOW_S)
    mine = listener.stored(prompt)
    assert {event.port_rank for event in mine} == {rank}
    assert {event.batch_rank for event in mine} == {rank}
    assert stored_tokens(listener, prompt) == full_blocks
    assert mine[0].parent_block_hash is None
    for event in mine:
        assert len(event.token_ids) == len(event.block_hashes) * block


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("value", ["abc", "-1", "1.0", ""])
def test_malformed_rank_is_invalid_argument(
    engine_channel: grpc.Channel, call: str, value: str
) -> None:
    request = make_request(fresh_prompt(8))
    error = rpc_error(lambda: CALLS[call](engine_channel, request, value))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == PARSE_ERROR


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("value", ["2", "7"])
def test_rank_outside_the_frontend_is_invalid_argument(
    engine_channel: grpc.Channel, engine: EngineUnderTest, call: str, value: str
) -> None:
    request = make_request(fresh_prompt(8))
    error = rpc_error(lambda: CALLS[call](engine_channel, request, value))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    connected = ", ".join(str(rank) for rank in range(engine.dp_size))
    expected = (
        f"data parallel rank {value} is not connected to this frontend; "
        f"connected ranks: [{connected}]"
    )
    assert expected in (error.details() or "")
