"""KV-cache events exactly as vLLM 0.32 publishes them, and the per-rank ZMQ publisher.

Wire format (SPEC §6 and tests/conformance/FACTS.md): three frames per batch — topic, 8-byte
big-endian sequence, msgpack payload. The payload is an array-encoded ``EventBatch``
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``"type"``; replay
replies are ``["", topic, seq, payload]`` and end with ``["", "", -1, ""]``. The PUB socket
binds when the endpoint has a wildcard (``*``/``::``) or is ``ipc://``/``inproc://`` and
connects otherwise, like vLLM's heuristic; the replay ROUTER always binds and keeps a bounded
buffer of past batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from rankgate.mocker.config import EventFormat

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REBIND_ATTEMPTS = 150
MEDIUM_GPU = "GPU"


class KvEvent(msgspec.Struct, tag=True, gc=False):
    """Base of the three event types; the tag is the class name under key ``type``."""


class BlockStored(KvEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    # vLLM 0.32 sends the KV-cache group and its spec with every stored batch.
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"


class BlockRemoved(KvEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = 0


class AllBlocksCleared(KvEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# Older vLLM builds (and peers written against them) encode events as tagged arrays.
class _ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None


class _ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class _ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


def _as_array(event: KvEvent) -> msgspec.Struct:
    if isinstance(event, BlockStored):
        return _ArrayStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
        )
    if isinstance(event, BlockRemoved):
        return _ArrayRemoved(event.block_hashes, event.medium)
    return _ArrayCleared()


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard or local transports bind; anything else connects."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KvEventPublisher:
    """One rank's PUB socket, sequence counter and replay service.

    Faults are part of its surface: ``restart`` reopens the sockets with the sequence back at
    0 (what subscribers see when vLLM restarts), and ``drop_next`` silently skips batches
    while still consuming their sequence numbers, so subscribers observe a gap.
    """

    def __init__(
        self,
        *,
        context: zmq.asyncio.Context,
        rank: int,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        buffer_steps: int,
        hwm: int,
        event_format: EventFormat = "map",
    ) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._context = context
        self._topic = topic.encode()
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._format = event_format
        self._seq = 0
        self._drop = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.published = 0
        self.dropped = 0
        # Faults of the publisher alone (the engine serves on): it goes silent; the batches it
        # drops are lost to replay too; what it says of its blocks is wrong.
        self.silent = False
        self.forget_dropped = False
        self.block_size_override: int | None = None
        self.token_offset = 0

    @property
    def next_sequence(self) -> int:
        return self._seq

    def open(self) -> None:
        try:
            self._open()
        except zmq.ZMQError:
            for sock in (self._pub, self._replay):
                if sock is not None:
                    sock.close(linger=0)
            self._pub = self._replay = None
            raise

    def _open(self) -> None:
        # Each socket is held before it binds, so that a failed bind closes it: a socket left
        # open would make the context's term() wait for it forever.
        pub = self._pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(self.endpoint):
            pub.bind(self.endpoint)
        else:
            pub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            replay = self._replay = self._context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.replay_endpoint)
            self._replay_task = asyncio.get_running_loop().create_task(
                self._serve_replay(replay), name=f"kv-replay-{self.rank}"
            )

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = None
        self._replay = None

    async def restart(self) -> None:
        """Close and reopen, forgetting the sequence and the replay buffer.

        ZMQ releases a closed socket's port asynchronously, so rebinding retries briefly.
        """
        await self.close()
        self._seq = 0
        self._buffer.clear()
        for attempt in range(_REBIND_ATTEMPTS):
            try:
                self.open()
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or attempt == _REBIND_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.02)

    def drop_next(self, batches: int) -> None:
        self._drop += batches

    def publish(self, events: list[KvEvent]) -> None:
        if not events or self._pub is None or self.silent:
            return
        if self.block_size_override is not None or self.token_offset:
            events = [self._distort(event) for event in events]
        seq = self._seq
        self._seq += 1
        body: list[Any] = events if self._format == "map" else [_as_array(e) for e in events]
        payload = self._encoder.encode(EventBatch(time.time(), body, self.rank))
        if not (self._drop and self.forget_dropped):
            self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
            self.dropped += 1
            return
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped += 1

    def _distort(self, event: KvEvent) -> KvEvent:
        if not isinstance(event, BlockStored):
            return event
        return msgspec.structs.replace(
            event,
            block_size=self.block_size_override or event.block_size,
            token_ids=[token + self.token_offset for token in event.token_ids],
        )

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring malformed replay request with %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            topic = self._topic
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            # Observed on vLLM 0.32: replies carry the topic; the end marker an empty one.
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))
