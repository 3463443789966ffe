"""A vLLM-format KV-event publisher for the routing tests: exact frames, real ZMQ sockets.

It binds an XPUB (wire-identical to vLLM's PUB) so a test can wait for the router's
subscription before publishing, and optionally a replay ROUTER that answers exactly like
vLLM's: one ``["", seq, payload]`` per buffered batch from the requested sequence, then
``["", -1, ""]``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import zmq

from tests.support.polling import wait_until
from tests.support.ports import free_port

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BatchShape = Literal["array", "map"]
EventShape = Literal["map", "array"]

_encoder = msgspec.msgpack.Encoder()


def stored(
    hashes: Sequence[int],
    tokens: Sequence[int],
    *,
    parent: int | None = None,
    block_size: int,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": None
        if extra_keys is None
        else [None if keys is None else list(keys) for keys in extra_keys],
    }


def removed(hashes: Sequence[int], medium: str | None = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


_ARRAY_ORDER = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def encode_batch(
    events: Sequence[dict[str, Any]],
    rank: int,
    batch_shape: BatchShape = "array",
    event_shape: EventShape = "map",
) -> bytes:
    if event_shape == "array":
        body: list[Any] = [
            [event["type"], *(event[name] for name in _ARRAY_ORDER[event["type"]])]
            for event in events
        ]
    else:
        body = list(events)
    ts = time.time()
    if batch_shape == "map":
        return _encoder.encode({"ts": ts, "events": body, "data_parallel_rank": rank})
    return _encoder.encode([ts, body, rank])


class TestPublisher:
    """One rank's publisher; ``replay`` adds a ROUTER serving every batch ever published."""

    __test__ = False

    def __init__(self, rank: int, *, topic: str = "kv", replay: bool = True) -> None:
        self.rank = rank
        self.topic = topic
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = free_port()
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0
        # Everything published, what the replay ROUTER can serve (from ``replay_floor`` on).
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_floor = 0
        self.replay_requests: list[int] = []
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            replay_port = free_port()
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        """Block until a subscriber's subscription arrives (no slow-joiner losses after)."""
        if not self.pub.poll(int(timeout * 1000)):
            raise TimeoutError("no subscriber connected to the test publisher")
        message = self.pub.recv()
        assert message[:1] == b"\x01", message

    def publish(
        self,
        events: Sequence[dict[str, Any]],
        *,
        seq: int | None = None,
        deliver: bool = True,
        batch_shape: BatchShape = "array",
        event_shape: EventShape = "map",
    ) -> int:
        """Publish one batch; ``deliver=False`` only buffers it for replay (a lost batch)."""
        if seq is not None:
            self.seq = seq
        number = self.seq
        self.seq += 1
        payload = encode_batch(events, self.rank, batch_shape, event_shape)
        self.buffer.append((number, payload))
        if deliver:
            self.pub.send_multipart((self.topic.encode(), number.to_bytes(8, "big"), payload))
        return number

    def rebind(self) -> None:
        """Close the PUB socket and bind a new one on the same port, counting from 0 again:
        what a subscriber sees when the engine restarts."""
        self.pub.close(linger=0)
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # ZMQ releases the closed socket's port in the background.
        wait_until(self._bound, 2, f"{self.endpoint} free to bind again")
        self.seq = 0
        self.wait_subscribed(timeout=10.0)

    def _bound(self) -> bool:
        try:
            self.pub.bind(self.endpoint)
        except zmq.ZMQError:
            return False
        return True

    def send_raw(self, frames: Sequence[bytes]) -> None:
        self.pub.send_multipart(list(frames))

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for number, payload in list(self.buffer):
                if number >= first and number >= self.replay_floor:
                    self.router.send_multipart((identity, b"", number.to_bytes(8, "big"), payload))
            self.router.send_multipart((identity, b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
            self.router.close(linger=0)
        self.pub.close(linger=0)
        self.context.term()
