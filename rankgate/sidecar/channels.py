"""A small pool of long-lived connections to the one vLLM frontend.

Each slot keeps its own connections, so concurrent streams spread over a few TCP connections
instead of queueing behind one connection's flow control; a request picks the next slot in
turn. Stubs are built once per slot, never per request. The hot ``Inference`` calls go over
:class:`~rankgate.sidecar.inference_client.InferenceClient` (a lean HTTP/2 client that costs a
fraction of grpc.aio per message), and so do the health watch's probes once started; the startup's
health wait, discovery and control stay on grpcio channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from rankgate.sidecar.endpoint import Endpoint
from rankgate.sidecar.inference_client import InferenceClient, tls_context
from rankgate.wire.proto.vllm import control_pb2_grpc, kv_transfer_pb2_grpc

# Images travel inline as raw bytes; 64 MiB leaves room for several large ones per request.
MAX_MESSAGE_BYTES = 64 << 20

_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.primary_user_agent", "rankgate"),
    # Reconnect quickly after an engine restart instead of backing off for tens of seconds.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)

# The generated stub classes are untyped; every call through them is checked at our boundary.
_CONTROL_STUB: Any = control_pb2_grpc.ControlStub
_KV_TRANSFER_STUB: Any = kv_transfer_pb2_grpc.KvTransferStub
_HEALTH_STUB: Any = health_pb2_grpc.HealthStub


@dataclass(frozen=True, slots=True)
class Stubs:
    """The clients of one slot."""

    inference: InferenceClient
    control: Any
    kv_transfer: Any
    health: Any


class ChannelPool:
    def __init__(
        self,
        endpoint: Endpoint,
        size: int,
        tls_ca_file: str | None = None,
        retry_after: float = 1.0,
    ) -> None:
        credentials = None
        tls = None
        if endpoint.tls:
            roots = Path(tls_ca_file).read_bytes() if tls_ca_file else None
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            tls = tls_context(tls_ca_file)
        self._channels: list[Any] = []
        stubs: list[Stubs] = []
        for _ in range(size):
            if credentials is None:
                channel = grpc.aio.insecure_channel(endpoint.target, options=_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(endpoint.target, credentials, options=_OPTIONS)
            self._channels.append(channel)
            stubs.append(
                Stubs(
                    inference=InferenceClient(endpoint, MAX_MESSAGE_BYTES, tls, retry_after),
                    control=_CONTROL_STUB(channel),
                    kv_transfer=_KV_TRANSFER_STUB(channel),
                    health=_HEALTH_STUB(channel),
                )
            )
        self._stubs = tuple(stubs)
        self._next = 0

    @property
    def size(self) -> int:
        return len(self._stubs)

    @property
    def first(self) -> Stubs:
        """Control-plane calls (health, discovery, abort) always use the first slot."""
        return self._stubs[0]

    def pick(self) -> Stubs:
        index = self._next
        self._next = (index + 1) % len(self._stubs)
        return self._stubs[index]

    async def close(self, grace: float | None = None) -> None:
        for stubs in self._stubs:
            await stubs.inference.close()
        for channel in self._channels:
            await channel.close(grace)
