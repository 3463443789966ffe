"""Ending requests early: Control.Abort, and a client that walks away from its stream."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from rankgate.wire.proto.vllm import control_pb2, inference_pb2
from tests.conformance.helpers import (
    RPC_TIMEOUT_S,
    FinishReason,
    KvEventListener,
    control,
    fold,
    fresh_prompt,
    inference,
    kv_listener,
    make_request,
    rank_metadata,
)
from tests.support.engines import EngineUnderTest

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("warm_engine")]

MAX_MODEL_LEN = 512
# The chain must stay still this long before the engine counts as no longer generating.
QUIET_S = 1.5
SETTLE_LIMIT_S = 30.0
# Runs that end before their Abort arrives are not judged; this many may be tried.
ABORT_ATTEMPTS = 5


@pytest.fixture
def abortable(engine: EngineUnderTest) -> Iterator[None]:
    """On the mock, steps of a millisecond: a zero-latency engine finishes a whole run before
    an Abort sent after its first tokens can land on a busy machine; at this pace a run takes
    half a second. Real vLLM on the CPU is slower than that by itself."""
    if engine.mock is None:
        yield
        return
    engine.mock.faults.slow_steps(0.001)
    try:
        yield
    finally:
        engine.mock.faults.slow_steps(0.0)


def long_request(prompt: list[int]) -> inference_pb2.GenerateRequest:
    """Runs to the context limit unless stopped: only an abort can end it early."""
    limit = MAX_MODEL_LEN - len(prompt)
    return make_request(
        prompt, stopping=inference_pb2.StoppingCriteria(max_new_tokens=limit, ignore_eos=True)
    )


@pytest.mark.usefixtures("abortable")
def test_control_abort_ends_stream_with_aborted(engine_channel: grpc.Channel) -> None:
    # A run that finishes all its tokens before the Abort lands says nothing about Abort, so
    # it is tried again with a fresh prompt.
    for _ in range(ABORT_ATTEMPTS):
        request = long_request(fresh_prompt(16))
        limit = request.stopping.max_new_tokens
        call = inference(engine_channel).GenerateStream(
            request, timeout=RPC_TIMEOUT_S, metadata=rank_metadata(0)
        )
        started = time.monotonic()
        head = [next(call), next(call)]
        assert head[1].outputs.token_ids, "generation had not started"
        first_token_s = time.monotonic() - started
        control(engine_channel).Abort(
            control_pb2.AbortRequest(request_ids=[request.request_id]), timeout=RPC_TIMEOUT_S
        )
        abort_s = time.monotonic() - started
        result = fold([*head, *call])
        end_s = time.monotonic() - started
        if result.reason == FinishReason.LENGTH and len(result.token_ids) == limit:
            continue
        assert result.reason == FinishReason.ABORTED, (
            f"first token {first_token_s:.3f}s, abort sent {abort_s:.3f}s, end {end_s:.3f}s"
        )
        assert result.finish is not None
        assert len(result.token_ids) < limit
        assert result.stop_kind is None
        return
    pytest.fail(f"every one of {ABORT_ATTEMPTS} requests ran to its limit before the Abort")


def test_abort_of_an_unknown_request_is_ok(engine_channel: grpc.Channel) -> None:
    reply = control(engine_channel).Abort(
        control_pb2.AbortRequest(request_ids=["conf-never-sent"]), timeout=RPC_TIMEOUT_S
    )
    assert isinstance(reply, control_pb2.AbortResponse)


def wait_until_quiet(listener: KvEventListener, root: object) -> int:
    """Pump until the request's block chain stops growing; returns its length."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    length, still_since = len(listener.chain(root)), time.monotonic()
    while time.monotonic() - still_since < QUIET_S:
        assert time.monotonic() < deadline, "the block chain never stopped growing"
        listener.pump(0.1)
        grown = len(listener.chain(root))
        if grown != length:
            length, still_since = grown, time.monotonic()
    return length


def decoded_blocks_of_a_full_run(engine: EngineUnderTest) -> int:
    """Blocks stored past the one-block prompt; the last sampled token never enters the cache."""
    return (MAX_MODEL_LEN - 1) // engine.block_size - 1


def test_a_stream_read_to_the_end_stores_every_decoded_block(
    engine_channel: grpc.Channel, engine: EngineUnderTest
) -> None:
    """The control for the drop test: the same request, read to the end, fills the chain."""
    prompt = fresh_prompt(engine.block_size)
    request = long_request(prompt)
    with kv_listener(engine) as listener:
        call = inference(engine_channel).GenerateStream(
            request, timeout=RPC_TIMEOUT_S, metadata=rank_metadata(1)
        )
        result = fold(call)
        listener.wait_for(lambda _: listener.stored(prompt))
        root = listener.stored(prompt)[0].block_hashes[-1]
        decoded_blocks = wait_until_quiet(listener, root)
    assert result.reason == FinishReason.LENGTH
    assert decoded_blocks == decoded_blocks_of_a_full_run(engine)


@pytest.mark.usefixtures("abortable")
def test_dropping_the_stream_aborts_the_request(
    engine_channel: grpc.Channel, engine: EngineUnderTest
) -> None:
    """A running request stores a block every block_size tokens; after the drop they stop.

    As with Abort, a run that reaches its limit before the cancel lands says nothing about the
    drop, so it is tried again with a fresh prompt.
    """
    full_run_blocks = decoded_blocks_of_a_full_run(engine)
    for _ in range(ABORT_ATTEMPTS):
        prompt = fresh_prompt(engine.block_size)
        request = long_request(prompt)
        with kv_listener(engine) as listener:
            call = inference(engine_channel).GenerateStream(
                request, timeout=RPC_TIMEOUT_S, metadata=rank_metadata(1)
            )
            next(call)
            assert next(call).outputs.token_ids, "generation had not started"
            call.cancel()
            listener.wait_for(lambda _, prompt=prompt: listener.stored(prompt))
            root = listener.stored(prompt)[0].block_hashes[-1]
            decoded_blocks = wait_until_quiet(listener, root)
        assert {event.port_rank for event in listener.stored(prompt)} == {1}
        if decoded_blocks == full_run_blocks:
            continue
        # ignore_eos and a limit at the context length: only an abort ends it short of the
        # limit.
        assert decoded_blocks < full_run_blocks
        return
    pytest.fail(f"every one of {ABORT_ATTEMPTS} requests ran to its limit before the drop")
