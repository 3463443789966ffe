"""The KV-event wire: frames, sequence numbers, the cache salt's mark, and replay."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import zmq

from rankgate.wire.proto.vllm import control_pb2, inference_pb2
from tests.conformance.helpers import (
    REPLAY_END_SEQ,
    KvEvent,
    decode_batch,
    fresh_prompt,
    kv_listener,
    make_request,
    stream,
)
from tests.support.engines import EngineUnderTest

pytestmark = pytest.mark.timeout(120)

SALTS = ("conf-salt-a", "conf-salt-b")
REPLAY_POLL_MS = 10_000


def test_frames_carry_the_advertised_topic_and_consecutive_seqs(
    engine_channel: grpc.Channel,
    engine: EngineUnderTest,
    kv_sources: list[control_pb2.KvEventSource],
) -> None:
    prompts = [fresh_prompt(2 * engine.block_size) for _ in range(3)]
    with kv_listener(engine) as listener:
        for prompt in prompts:
            stream(engine_channel, make_request(prompt, max_new_tokens=1), rank=0)
            listener.wait_for(lambda _, prompt=prompt: listener.stored(prompt))
    assert listener.topics == {kv_sources[0].topic.encode()}
    seqs = listener.seqs[0]
    assert len(seqs) >= len(prompts)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def salted_blocks(
    channel: grpc.Channel, engine: EngineUnderTest, prompt: list[int], salt: str
) -> list[KvEvent]:
    request = make_request(
        prompt, max_new_tokens=1, kv=inference_pb2.KVCacheParameters(cache_salt=salt)
    )
    with kv_listener(engine) as listener:
        stream(channel, request, rank=0)
        listener.wait_for(lambda _: listener.stored(prompt))
    return listener.stored(prompt)


def test_cache_salt_changes_block_identity(
    engine_channel: grpc.Channel, engine: EngineUnderTest
) -> None:
    prompt = fresh_prompt(2 * engine.block_size + 3)
    runs = {salt: salted_blocks(engine_channel, engine, prompt, salt) for salt in (*SALTS, "")}
    hashes = {salt: [h for e in events for h in e.block_hashes] for salt, events in runs.items()}
    # The same tokens stored three times: the salt, not the prompt, told them apart.
    assert all(len(found) == 2 for found in hashes.values())
    assert len({tuple(found) for found in hashes.values()}) == 3
    for salt in SALTS:
        extra = [key for event in runs[salt] for key in (event.extra_keys or ())]
        assert extra[0] is not None
        assert salt in extra[0]
        assert extra[1] is None
    unsalted = [key for event in runs[""] for key in (event.extra_keys or ())]
    assert all(key is None for key in unsalted)


def replay(engine: EngineUnderTest, rank: int, start: int) -> list[tuple[int, bytes]]:
    """Ask the rank's replay ROUTER for everything from ``start``; (seq, payload) up to the end."""
    assert engine.kv_replay_base_port is not None
    context: zmq.Context[Any] = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{engine.host}:{engine.kv_replay_base_port + rank}")
    answers: list[tuple[int, bytes]] = []
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        while True:
            assert dealer.poll(REPLAY_POLL_MS), "replay stopped answering before its end marker"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            assert len(frames) in (3, 4), f"unexpected replay frames: {frames}"
            seq = int.from_bytes(frames[-2], "big", signed=True)
            answers.append((seq, frames[-1]))
            if seq == REPLAY_END_SEQ:
                return answers
    finally:
        dealer.close(linger=0)


def test_replay_returns_buffered_batches_then_end_marker(
    engine_channel: grpc.Channel, engine: EngineUnderTest
) -> None:
    prompt = fresh_prompt(engine.block_size + 1)
    with kv_listener(engine) as listener:
        stream(engine_channel, make_request(prompt, max_new_tokens=1), rank=1)
        listener.wait_for(lambda _: listener.stored(prompt))
    live_seq = listener.stored(prompt)[0].seq

    answers = replay(engine, rank=1, start=0)
    assert answers[-1] == (REPLAY_END_SEQ, b"")
    seqs = [seq for seq, _ in answers[:-1]]
    assert seqs == list(range(len(seqs)))
    assert live_seq in seqs
    rank, events = decode_batch(dict(answers[:-1])[live_seq])
    assert rank == 1
    assert any(tuple(event["token_ids"]) == tuple(prompt[: engine.block_size]) for event in events)

    tail = replay(engine, rank=1, start=live_seq)
    assert [seq for seq, _ in tail[:-1]] == list(range(live_seq, seqs[-1] + 1))
    assert tail[-1] == (REPLAY_END_SEQ, b"")
