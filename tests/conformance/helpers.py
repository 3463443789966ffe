"""Raw-stub plumbing shared by the conformance tests.

The suite must pin vLLM's behaviour, not ours, so nothing here imports project code: requests are
built from the generated stubs, KV events are decoded from the ZMQ wire by hand, and every RPC and
socket read carries a deadline so that a misbehaving engine fails a test instead of hanging it.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgpack
import pytest
import zmq
from tokenizers import Tokenizer
from zmq.utils.monitor import recv_monitor_message

from rankgate.wire.proto.vllm import control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.support.engines import EngineUnderTest
from tests.support.polling import wait_until

RPC_TIMEOUT_S = 60.0
RANK_HEADER = "x-data-parallel-rank"
# Merged BPE tokens of the tiny tokenizer: ordinary text, far from the special ids 0..5.
ORDINARY_IDS = range(300, 1000)
EOS_TOKEN_ID = 1
REPLAY_END_SEQ = -1

FinishReason = inference_pb2.FinishInfo.FinishReason


def engine_specific(engine: EngineUnderTest, kind: str, reason: str) -> None:
    """Skip unless the engine is ``kind``; the reason ends up in the test report and FACTS.md."""
    if engine.kind != kind:
        pytest.skip(f"{kind}-only fact: {reason}")


# The generated stub constructors are untyped; the stubs' own .pyi types are what tests use.
_INFERENCE_STUB: Any = inference_pb2_grpc.InferenceStub
_CONTROL_STUB: Any = control_pb2_grpc.ControlStub


def inference(channel: grpc.Channel) -> inference_pb2_grpc.InferenceStub:
    stub: inference_pb2_grpc.InferenceStub = _INFERENCE_STUB(channel)
    return stub


def control(channel: grpc.Channel) -> control_pb2_grpc.ControlStub:
    stub: control_pb2_grpc.ControlStub = _CONTROL_STUB(channel)
    return stub


def prompt_ids(tag: str, length: int) -> list[int]:
    """A prompt unique to ``tag``, so that no test hits blocks another test left in the cache."""
    rng = random.Random(f"{tag}:{length}")
    return [rng.choice(ORDINARY_IDS) for _ in range(length)]


def fresh_prompt(length: int) -> list[int]:
    """A prompt no earlier run can have cached: KV-event checks need blocks to be stored anew."""
    return prompt_ids(uuid.uuid4().hex, length)


def request_id(tag: str) -> str:
    return f"conf-{tag}-{uuid.uuid4().hex[:12]}"


def make_request(
    prompt: Sequence[int],
    *,
    tag: str = "req",
    max_new_tokens: int = 4,
    temperature: float | None = 0.0,
    **fields: Any,
) -> inference_pb2.GenerateRequest:
    """A token-in request that asks for text and token ids back, greedy unless told otherwise."""
    fields.setdefault("stopping", inference_pb2.StoppingCriteria(max_new_tokens=max_new_tokens))
    fields.setdefault(
        "response", inference_pb2.ResponseOptions(output_text=True, output_token_ids=True)
    )
    request = inference_pb2.GenerateRequest(
        request_id=request_id(tag), token_ids=inference_pb2.TokenIds(ids=list(prompt)), **fields
    )
    if temperature is not None:
        request.temperature = temperature
    return request


def rank_metadata(rank: int | str | None) -> tuple[tuple[str, str], ...]:
    return () if rank is None else ((RANK_HEADER, str(rank)),)


@dataclass
class Generation:
    """A finished stream folded into what the tests compare."""

    messages: list[inference_pb2.GenerateResponse]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    candidates: list[inference_pb2.CandidateTokenInfo] = field(default_factory=list)
    finish: inference_pb2.FinishInfo | None = None

    @property
    def reason(self) -> int:
        assert self.finish is not None, "stream ended without finish_info"
        return self.finish.finish_reason

    @property
    def stop_kind(self) -> str | None:
        assert self.finish is not None, "stream ended without finish_info"
        kind: str | None = self.finish.WhichOneof("stop_reason")
        return kind


def fold(messages: Iterable[inference_pb2.GenerateResponse]) -> Generation:
    result = Generation(messages=list(messages))
    for message in result.messages:
        out = message.outputs
        result.text += out.text
        result.token_ids.extend(out.token_ids)
        result.logprobs.extend(out.logprobs)
        result.ranks.extend(out.ranks)
        result.candidates.extend(out.candidate_tokens)
        if out.HasField("finish_info"):
            result.finish = out.finish_info
    return result


def stream(
    channel: grpc.Channel,
    request: inference_pb2.GenerateRequest,
    rank: int | str | None = None,
) -> Generation:
    calls = inference(channel).GenerateStream(
        request, timeout=RPC_TIMEOUT_S, metadata=rank_metadata(rank)
    )
    return fold(calls)


def unary(
    channel: grpc.Channel,
    request: inference_pb2.GenerateRequest,
    rank: int | str | None = None,
) -> inference_pb2.GenerateResponse:
    response: inference_pb2.GenerateResponse = inference(channel).Generate(
        request, timeout=RPC_TIMEOUT_S, metadata=rank_metadata(rank)
    )
    return response


def rpc_error(call: Any) -> grpc.RpcError:
    """Run ``call`` (which must fail) and return its error, draining a stream if it is one."""
    with pytest.raises(grpc.RpcError) as caught:
        _drain(call)
    return caught.value


def _drain(call: Any) -> None:
    result = call()
    if isinstance(result, Iterator):
        for _ in result:
            pass


# --------------------------------------------------------------------------------------------
# KV events


@dataclass(frozen=True)
class KvEvent:
    """One decoded event with the publisher it came from, the only thing rank checks trust."""

    kind: str
    port_rank: int
    batch_rank: int | None
    seq: int
    block_hashes: tuple[Any, ...]
    parent_block_hash: Any
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None


def decode_batch(payload: bytes) -> tuple[int | None, list[Any]]:
    """(data_parallel_rank, events) from an EventBatch sent as an array or as a map."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(batch, dict):
        return batch.get("data_parallel_rank"), list(batch.get("events") or [])
    events = list(batch[1]) if len(batch) > 1 else []
    rank = batch[2] if len(batch) > 2 else None
    return rank, events


# Field order of the array (tag-first) encoding, after the tag itself.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def decode_event(raw: Any, port_rank: int, batch_rank: int | None, seq: int) -> KvEvent:
    if isinstance(raw, dict):
        kind = str(raw.get("type"))
        fields = raw
    else:
        kind = str(raw[0])
        fields = dict(zip(_ARRAY_FIELDS.get(kind, ()), raw[1:], strict=False))
    extra = fields.get("extra_keys")
    return KvEvent(
        kind=kind,
        port_rank=port_rank,
        batch_rank=batch_rank,
        seq=seq,
        block_hashes=tuple(fields.get("block_hashes") or ()),
        parent_block_hash=fields.get("parent_block_hash"),
        token_ids=tuple(fields.get("token_ids") or ()),
        extra_keys=None if extra is None else tuple(extra),
    )


class KvEventListener:
    """SUB sockets on every rank's publisher, connected before the request that is observed."""

    def __init__(self, engine: EngineUnderTest, context: zmq.Context[Any]) -> None:
        self.topics: set[bytes] = set()
        assert engine.kv_events_base_port is not None, "engine runs without KV events"
        self._engine = engine
        self._poller = zmq.Poller()
        self._sockets: dict[Any, int] = {}
        self._monitors: list[Any] = []
        for rank in range(engine.dp_size):
            sock = context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt_string(zmq.SUBSCRIBE, "")
            self._monitors.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
            sock.connect(f"tcp://{engine.host}:{engine.kv_events_base_port + rank}")
            self._poller.register(sock, zmq.POLLIN)
            self._sockets[sock] = rank
        self.events: list[KvEvent] = []
        self.seqs: dict[int, list[int]] = {rank: [] for rank in range(engine.dp_size)}

    def wait_connected(self, timeout: float) -> None:
        """Block until every SUB has finished its ZMTP handshake with its publisher."""
        deadline = time.monotonic() + timeout
        for sock, monitor in zip(self._sockets, self._monitors, strict=True):
            while True:
                left = deadline - time.monotonic()
                assert left > 0, "a KV-event publisher never completed the ZMQ handshake"
                if monitor.poll(max(1, int(left * 1000))):
                    event = recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        break
            sock.disable_monitor()
            monitor.close(linger=0)
        self._monitors.clear()

    def close(self) -> None:
        for monitor in self._monitors:
            monitor.close(linger=0)
        for sock in self._sockets:
            sock.close(linger=0)

    def pump(self, seconds: float) -> list[KvEvent]:
        """Read whatever arrives within ``seconds``; returns the events read in this call."""
        fresh: list[KvEvent] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in self._poller.poll(timeout=max(1, int(left * 1000))):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    fresh.extend(self._decode(frames, self._sockets[sock]))
        self.events.extend(fresh)
        return fresh

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> list[KvEvent]:
        """Pump until ``predicate(self.events)`` holds; fails the test on timeout."""

        def satisfied() -> bool:
            if predicate(self.events):
                return True
            self.pump(0.2)
            return bool(predicate(self.events))

        wait_until(satisfied, timeout, lambda: f"KV events never satisfied it: {self.events}")
        return self.events

    def _decode(self, frames: list[bytes], port_rank: int) -> list[KvEvent]:
        assert len(frames) == 3, f"expected 3 frames (topic, seq, payload), got {len(frames)}"
        topic, seq_bytes, payload = frames
        self.topics.add(topic)
        assert len(seq_bytes) == 8, f"sequence frame is {len(seq_bytes)} bytes, not 8"
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        self.seqs[port_rank].append(seq)
        batch_rank, raw_events = decode_batch(payload)
        return [decode_event(raw, port_rank, batch_rank, seq) for raw in raw_events]

    def chain(self, root: Any) -> list[KvEvent]:
        """BlockStored events that extend the block ``root`` through parent links, in order."""
        known = {root}
        found: list[KvEvent] = []
        for event in self.events:
            if event.kind == "BlockStored" and event.parent_block_hash in known:
                found.append(event)
                known.update(event.block_hashes)
        return found

    def stored(self, token_ids: Sequence[int]) -> list[KvEvent]:
        """BlockStored events whose tokens lie inside ``token_ids`` (this request's blocks)."""
        text = tuple(token_ids)
        return [
            event
            for event in self.events
            if event.kind == "BlockStored" and event.token_ids and _contains(text, event.token_ids)
        ]


def _contains(haystack: tuple[int, ...], needle: tuple[int, ...]) -> bool:
    width = len(needle)
    return any(haystack[i : i + width] == needle for i in range(len(haystack) - width + 1))


CONNECT_TIMEOUT_S = 10.0
# After the handshake the subscription still has to reach the publisher's I/O thread.
SUBSCRIBE_SETTLE_S = 0.2


@contextmanager
def kv_listener(engine: EngineUnderTest) -> Iterator[KvEventListener]:
    """Connect to every publisher and wait until the subscriptions are live before yielding.

    ZMQ drops whatever is published before a subscription reaches the publisher, so this wait is
    what makes "no event on the other rank" and "every block was stored" mean something.
    """
    context: zmq.Context[Any] = zmq.Context.instance()
    listener = KvEventListener(engine, context)
    try:
        listener.wait_connected(CONNECT_TIMEOUT_S)
        listener.pump(SUBSCRIBE_SETTLE_S)
        yield listener
    finally:
        listener.close()


# --------------------------------------------------------------------------------------------
# Text


def load_tokenizer(engine: EngineUnderTest) -> Tokenizer:
    return Tokenizer.from_file(str(engine.tokenizer_dir / "tokenizer.json"))


def whitespace_bias(tokenizer: Tokenizer) -> dict[int, float]:
    """Logit bias that keeps a random model from padding JSON with whitespace forever.

    JSON grammars allow whitespace between every token; a random model then loops on it and never
    closes the object. Pushing whitespace-only tokens down leaves every structural token allowed.
    """
    bias: dict[int, float] = {}
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id])
        if text and not text.strip():
            bias[token_id] = -100.0
    return bias
