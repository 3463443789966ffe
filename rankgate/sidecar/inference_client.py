"""vLLM's ``Inference`` service over one lean HTTP/2 connection (:mod:`rankgate.sidecar.http2`).

It stands in for the generated stub on the hot path with the same two methods, so the
generation code does not care which client it holds. Everything a request does not change is
built once: the header block of each (method, rank metadata) pair is encoded on first use and
reused. The connection is opened on first use and reopened after it is lost, so an engine
restart needs no help from the caller; calls made while it opens are started in order once it
is up, or fail with UNAVAILABLE when it cannot be opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from rankgate.sidecar.convert import merge_responses, wants_logprobs
from rankgate.sidecar.endpoint import Endpoint
from rankgate.sidecar.errors import SidecarError
from rankgate.sidecar.grpc_call import Call, UnaryCall, request_headers
from rankgate.sidecar.http2 import Connection
from rankgate.sidecar.status import Status, error_from_status
from rankgate.wire.grpc_frame import grpc_message
from rankgate.wire.proto.vllm import inference_pb2

GENERATE = "/vllm.Inference/Generate"
GENERATE_STREAM = "/vllm.Inference/GenerateStream"
CONNECT_TIMEOUT_S = 5.0
# Distinct metadata seen per method is one per DP rank in practice; the bound guards the rest.
MAX_HEADER_BLOCKS = 1024
TRACE_PARENT = "traceparent"

Metadata = tuple[tuple[str, str], ...]
GenerateRequest = inference_pb2.GenerateRequest
GenerateResponse = inference_pb2.GenerateResponse
_PARSE: Callable[[bytes], GenerateResponse] = GenerateResponse.FromString
T = TypeVar("T")


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2"])
    return context


class InferenceClient:
    """The two calls of ``vllm.Inference``; they fail with :mod:`rankgate.sidecar.errors` types,
    whose transient ones advertise ``retry_after`` seconds."""

    def __init__(
        self,
        endpoint: Endpoint,
        max_message: int,
        tls: ssl.SSLContext | None = None,
        retry_after: float = 1.0,
    ) -> None:
        self._endpoint = endpoint
        self._retry_after = retry_after
        self._max_message = max_message
        self._tls = tls
        self._scheme = "https" if tls is not None else "http"
        self._blocks: dict[tuple[str, Metadata | None], bytes] = {}
        self._conn: Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._waiting: list[tuple[Call[Any], bytes, bytes]] = []
        self._closed = False

    def Generate(
        self, message: GenerateRequest, metadata: Metadata | None = None
    ) -> UnaryCall[GenerateResponse]:
        call = UnaryCall(_PARSE, None, self._retry_after)
        self._start(call, GENERATE, message, metadata)
        return call

    def GenerateStream(
        self, message: GenerateRequest, metadata: Metadata | None = None
    ) -> Call[GenerateResponse]:
        """Server streaming; a reader that fell behind gets the messages already waiting
        merged into one where nothing is lost (``convert.merge_responses``), unless the
        request asks for logprobs."""
        merge = None if wants_logprobs(message) else merge_responses
        call = Call(_PARSE, merge, self._retry_after)
        self._start(call, GENERATE_STREAM, message, metadata)
        return call

    def unary(self, path: str, message: Message, parse: Callable[[bytes], T]) -> UnaryCall[T]:
        """A unary method of another service the engine serves on this connection (the
        health watch's probe): one more stream beside the requests, framed as they are."""
        call = UnaryCall(parse, None, self._retry_after)
        self._start(call, path, message, None)
        return call

    def _failure(self, status: Status, details: str) -> SidecarError:
        return error_from_status(status, details, self._retry_after)

    def _start(
        self,
        call: Call[Any],
        path: str,
        message: Message,
        metadata: Metadata | None,
    ) -> None:
        key = (path, metadata)
        headers = self._blocks.get(key)
        if headers is None:
            headers = self._header_block(key)
        body = grpc_message(message.SerializeToString())
        if len(body) - 5 > self._max_message:
            call.on_connection_error(
                self._failure(
                    Status.RESOURCE_EXHAUSTED,
                    f"request of {len(body) - 5} bytes exceeds {self._max_message}",
                )
            )
            return
        self._send(call, headers, body)

    def _send(self, call: Call[Any], headers: bytes, body: bytes) -> None:
        conn = self._conn
        if conn is not None and conn.usable:
            conn.start(call, headers, body)
            return
        if self._closed:
            call.on_connection_error(self._failure(Status.UNAVAILABLE, "client closed"))
            return
        self._waiting.append((call, headers, body))
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())

    def _header_block(self, key: tuple[str, Metadata | None]) -> bytes:
        path, metadata = key
        block = request_headers(self._scheme, self._endpoint.target, path, metadata or ())
        if metadata and any(name == TRACE_PARENT for name, _ in metadata):
            # A trace context is one call's own: its block is not worth keeping.
            return block
        if len(self._blocks) >= MAX_HEADER_BLOCKS:
            self._blocks.clear()
        self._blocks[key] = block
        return block

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        endpoint = self._endpoint
        try:
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(
                        lambda: Connection(
                            self._max_message, self._forget, self._send, self._retry_after
                        ),
                        endpoint.host,
                        endpoint.port,
                        ssl=self._tls,
                        server_hostname=endpoint.host if self._tls is not None else None,
                    ),
                    CONNECT_TIMEOUT_S,
                )
            except (OSError, TimeoutError) as error:
                waiting, self._waiting = self._waiting, []
                failure = self._failure(
                    Status.UNAVAILABLE,
                    f"cannot connect to the engine at {endpoint.target}: {error or 'timed out'}",
                )
                for call, _, _ in waiting:
                    call.on_connection_error(failure)
                return
            _no_delay(conn)
            if self._closed:
                conn.close()
            else:
                self._conn = conn
            waiting, self._waiting = self._waiting, []
            for call, headers, body in waiting:
                if not call.done():
                    conn.start(call, headers, body)
        finally:
            self._connecting = None

    def _forget(self, conn: Connection) -> None:
        if self._conn is conn:
            self._conn = None

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
        failure = self._failure(Status.UNAVAILABLE, "client closed")
        waiting, self._waiting = self._waiting, []
        for call, _, _ in waiting:
            call.on_connection_error(failure)
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _no_delay(conn: Connection) -> None:
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
