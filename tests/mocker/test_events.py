"""KV events on the wire: vLLM's framing, block identity (salt, LoRA, images), replay, faults."""

from __future__ import annotations

import io
from typing import Any

import msgpack
import zmq
from PIL import Image

from rankgate.wire.proto.vllm import control_pb2, inference_pb2
from tests.mocker.conftest import BLOCK, Client, Events, engine, prompt, request
from tests.support.mock_engine import MockEngineHandle

IMAGE_TOKEN = 5


def test_wire_format_matches_vllm(mock: MockEngineHandle, client: Client) -> None:
    base = mock.config.kv_events_port
    assert base is not None
    context: zmq.Context[Any] = zmq.Context.instance()
    sock = context.socket(zmq.SUB)
    sock.setsockopt_string(zmq.SUBSCRIBE, "")
    sock.connect(f"tcp://127.0.0.1:{base + 1}")
    try:
        # A subscription takes a moment to reach the publisher, and what is published before
        # it arrives is lost: send prompts until one is heard.
        sent: list[list[int]] = []
        for attempt in range(100):
            sent.append(prompt(1 + attempt, 40))
            client.stream(request(sent[-1]), rank=1)
            if sock.poll(100):
                break
        frames = sock.recv_multipart()
        assert len(frames) == 3
        topic, seq, payload = frames
        assert topic == b""
        assert len(seq) == 8
        batch = msgpack.unpackb(payload, strict_map_key=False)
        assert isinstance(batch, list)
        ts, events, rank = batch
        assert isinstance(ts, float)
        assert rank == 1
        stored = events[0]
        assert stored["type"] == "BlockStored"
        assert stored["token_ids"] in [tokens[: 2 * BLOCK] for tokens in sent]
        assert stored["block_size"] == BLOCK
        assert stored["parent_block_hash"] is None
        assert stored["medium"] == "GPU"
        assert stored["lora_name"] is None
        assert stored["extra_keys"] == [None, None]
        assert stored["group_idx"] == 0
        assert stored["kv_cache_spec_kind"] == "full_attention"
        assert len(stored["block_hashes"]) == 2
    finally:
        sock.close(linger=0)


def stored_for(listener: Events, rank: int, tokens: list[int]) -> list[dict[str, Any]]:
    listener.pump(0.3)
    return [e for e in listener.events(rank, "BlockStored") if e["token_ids"] == tokens]


def test_salt_changes_identity_and_lands_in_the_first_block(client: Client, events: Events) -> None:
    tokens = prompt(2, 2 * BLOCK + 1)
    client.stream(request(tokens), rank=0)
    salted = request(tokens)
    salted.kv.cache_salt = "rankgate-salt:tenant-a"
    client.stream(salted, rank=0)
    plain, salty = stored_for(events, 0, tokens[: 2 * BLOCK])
    assert set(plain["block_hashes"]).isdisjoint(salty["block_hashes"])
    assert salty["extra_keys"] == [["rankgate-salt:tenant-a"], None]


def test_lora_name_is_in_every_block() -> None:
    with engine(loras=("adapter-a",)) as handle:
        c = Client(handle.target)
        listener = Events(handle)
        try:
            tokens = prompt(3, 2 * BLOCK + 1)
            c.stream(request(tokens, lora_name="adapter-a"), rank=0)
            (event,) = stored_for(listener, 0, tokens[: 2 * BLOCK])
            assert event["lora_name"] == "adapter-a"
            assert event["extra_keys"] == [["adapter-a"], ["adapter-a"]]
            loras = c.control.ListLoras(control_pb2.ListLorasRequest(), timeout=5)
            assert [a.lora_name for a in loras.adapters] == ["adapter-a"]
        finally:
            listener.close()
            c.close()


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_images_expand_and_identify_their_blocks(client: Client, events: Events) -> None:
    uuid = "ab" * 32
    tokens = [*prompt(4, 3), IMAGE_TOKEN, *prompt(5, 3)]
    req = request(tokens)
    req.media.add(modality=inference_pb2.MODALITY_IMAGE, raw_bytes=png(56, 28), uuid=uuid)
    messages = client.stream(req, rank=1)
    # 56x28 at 28-pixel patches: 2 tokens replace the one placeholder.
    assert messages[0].prompt_info.num_prompt_tokens == len(tokens) - 1 + 2
    big = request([IMAGE_TOKEN, *prompt(6, 40)])
    big.media.add(modality=inference_pb2.MODALITY_IMAGE, raw_bytes=png(140, 140), uuid=uuid)
    messages = client.stream(big, rank=1)
    assert messages[0].prompt_info.num_prompt_tokens == 25 + 40
    events.pump(0.3)
    (event,) = [
        e for e in events.events(1, "BlockStored") if e["token_ids"][:25] == [IMAGE_TOKEN] * 25
    ]
    # vLLM 0.32's layout: [[id, offset of the image's start from the block's start]], the
    # offset negative in blocks the image began before.
    block = event["block_size"]
    assert event["extra_keys"][0] == [[uuid, 0]]
    assert event["extra_keys"][1] == [[uuid, -block]]
    assert event["extra_keys"][2] is None


def test_replay_returns_buffered_batches_then_the_end_marker(
    mock: MockEngineHandle, client: Client
) -> None:
    client.stream(request(prompt(7, 40)), rank=0)
    client.stream(request(prompt(8, 40)), rank=0)
    replay = mock.config.kv_replay_port
    assert replay is not None
    context: zmq.Context[Any] = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs: list[int] = []
        while True:
            assert dealer.poll(5000)
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            value = int.from_bytes(seq, "big", signed=True)
            if value == -1:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == mock.config.kv_events_topic.encode()
            seqs.append(value)
            assert msgpack.unpackb(payload, strict_map_key=False)[2] == 0
        assert seqs == list(range(len(seqs)))
        assert len(seqs) >= 2
    finally:
        dealer.close(linger=0)


def test_publisher_restart_and_dropped_batches_are_visible() -> None:
    with engine() as handle:
        c = Client(handle.target)
        listener = Events(handle)
        try:
            c.stream(request(prompt(9, 40)), rank=0)
            c.stream(request(prompt(10, 40)), rank=0)
            handle.faults.drop_kv_batches(1, rank=0)
            c.stream(request(prompt(11, 40)), rank=0)
            c.stream(request(prompt(12, 40)), rank=0)
            listener.pump(0.3)
            seqs = [seq for rank, seq, _ in listener.batches if rank == 0]
            assert seqs == [0, 1, 3], "the dropped batch leaves a gap"
            assert handle.stats(0).kv_batches_dropped == 1

            handle.faults.restart_kv_publisher(rank=0)
            listener.close()
            listener = Events(handle)
            c.stream(request(prompt(13, 40)), rank=0)
            listener.pump(0.3)
            assert [seq for rank, seq, _ in listener.batches if rank == 0] == [0]
        finally:
            listener.close()
            c.close()


def test_concrete_host_connects_to_a_binding_subscriber() -> None:
    """Like vLLM: an endpoint without a wildcard makes the publisher connect."""
    from tests.support.ports import free_port_range

    base = free_port_range(2)
    context: zmq.Context[Any] = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.bind(f"tcp://127.0.0.1:{base}")
    try:
        with engine(kv_events_port=base, kv_events_host="127.0.0.1", kv_replay_port=None) as h:
            c = Client(h.target)
            try:
                sources = c.control.GetKvEventSources(
                    control_pb2.GetKvEventSourcesRequest(), timeout=5
                ).sources
                assert sources[0].endpoint == f"tcp://127.0.0.1:{base}"
                assert sources[0].replay_endpoint == ""
                # As on real vLLM, batches published before the connection settles are lost.
                for seed in range(50):
                    c.stream(request(prompt(100 + seed, 40)), rank=0)
                    if sub.poll(200):
                        break
                frames = sub.recv_multipart()
                assert len(frames) == 3
                assert msgpack.unpackb(frames[2], strict_map_key=False)[2] == 0
            finally:
                c.close()
    finally:
        sub.close(linger=0)


def test_array_event_format_for_older_peers() -> None:
    with engine(kv_event_format="array") as handle:
        c = Client(handle.target)
        listener = Events(handle)
        try:
            c.stream(request(prompt(15, 40)), rank=0)
            listener.pump(0.3)
            (_, _, events) = listener.batches[0]
            assert events[0][0] == "BlockStored"
            assert events[0][4] == BLOCK
        finally:
            listener.close()
            c.close()
