"""Mocker fixtures: a small DP=2 engine with KV events, and helpers to talk to it over gRPC."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq

from rankgate.mocker.config import MockEngineConfig
from rankgate.wire.proto.vllm import control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.support.mock_engine import MockEngineHandle, running_mock_engine
from tests.support.ports import free_port, free_port_range

TOKENIZER = (
    Path(__file__).resolve().parents[2] / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
)
BLOCK = 16


def make_config(**overrides: Any) -> MockEngineConfig:
    fields: dict[str, Any] = {
        "port": free_port(),
        "dp_size": 2,
        "block_size": BLOCK,
        "model": "tiny-llama",
        "tokenizer": str(TOKENIZER),
        "kv_events_port": free_port_range(2),
        "kv_replay_port": free_port_range(2),
        "speed": 0.0,
    }
    fields.update(overrides)
    return MockEngineConfig(**fields)


@contextmanager
def engine(**overrides: Any) -> Iterator[MockEngineHandle]:
    with running_mock_engine(make_config(**overrides)) as handle:
        yield handle


@pytest.fixture(scope="module")
def mock() -> Iterator[MockEngineHandle]:
    with engine() as handle:
        yield handle


class Client:
    """Sync stubs on one channel, typed loosely: the generated constructors are untyped."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.inference: Any = inference_pb2_grpc.InferenceStub(self.channel)  # type: ignore[no-untyped-call]
        self.control: Any = control_pb2_grpc.ControlStub(self.channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self.channel.close()

    def stream(
        self, request: inference_pb2.GenerateRequest, rank: int | None = None
    ) -> list[inference_pb2.GenerateResponse]:
        metadata = () if rank is None else (("x-data-parallel-rank", str(rank)),)
        return list(self.inference.GenerateStream(request, metadata=metadata, timeout=30))


@pytest.fixture
def client(mock: MockEngineHandle) -> Iterator[Client]:
    c = Client(mock.target)
    yield c
    c.close()


def request(
    prompt: list[int],
    *,
    max_new_tokens: int = 4,
    request_id: str | None = None,
    **fields: Any,
) -> inference_pb2.GenerateRequest:
    fields.setdefault("stopping", inference_pb2.StoppingCriteria(max_new_tokens=max_new_tokens))
    fields.setdefault("response", inference_pb2.ResponseOptions(output_token_ids=True))
    return inference_pb2.GenerateRequest(
        request_id=request_id or f"t-{time.monotonic_ns()}",
        token_ids=inference_pb2.TokenIds(ids=prompt),
        temperature=0.0,
        **fields,
    )


def prompt(seed: int, length: int) -> list[int]:
    return [300 + (seed * 7919 + i * 104729) % 700 for i in range(length)]


class Events:
    """SUB sockets on every rank's publisher; decodes batches as (rank, seq, events)."""

    def __init__(self, handle: MockEngineHandle) -> None:
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self.sockets: dict[Any, int] = {}
        base = handle.config.kv_events_port
        assert base is not None
        self.poller = zmq.Poller()
        for rank in handle.ranks:
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt_string(zmq.SUBSCRIBE, "")
            sock.connect(f"tcp://127.0.0.1:{base + rank}")
            self.poller.register(sock, zmq.POLLIN)
            self.sockets[sock] = rank
        self.batches: list[tuple[int, int, list[Any]]] = []
        self.pump(0.3)

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in self.poller.poll(max(1, int(left * 1000))):
                while True:
                    try:
                        _, seq, payload = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    batch = msgpack.unpackb(payload, strict_map_key=False)
                    self.batches.append(
                        (self.sockets[sock], int.from_bytes(seq, "big", signed=True), batch[1])
                    )

    def events(self, rank: int | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        return [
            event
            for r, _, events in self.batches
            if rank is None or r == rank
            for event in events
            if kind is None or event["type"] == kind
        ]

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


@pytest.fixture
def events(mock: MockEngineHandle) -> Iterator[Events]:
    listener = Events(mock)
    yield listener
    listener.close()
