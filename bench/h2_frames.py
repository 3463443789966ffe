"""What does one streamed message cost in the HTTP/2 layers, without sockets or scheduling?

Two hot paths, each driven through its role's own entry points on an in-memory transport:

- client receive (the gateway, per token): ``data_received`` with chunks of ``--batch`` DATA
  frames of one GenerateResponse each, on an open call, and the reader taking each message
  (``Call._next``, what ``__anext__`` does when a message is waiting; parsing included);
- client request (the gateway, per non-streaming request): a unary call's request frames out,
  its response headers, one message and trailers in (all memoized header blocks), the reply
  taken;
- server send (the mock engine, per token): ``_queue_message`` of one serialized response on
  an open stream, and the per-iteration flush.

It prints the best of ``--repeats`` runs in ns per message; ``--once N`` runs one path
(``--path``) N times, for instruction counts under ``valgrind --tool=callgrind``: the
difference of two counts over the difference of their N is the cost of one message. The
script runs against whichever checkout's packages the interpreter imports, so the same file
measures an A/B pair of worktrees:

    .venv/bin/python bench/h2_frames.py [--messages 20000] [--batch 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import time
from typing import Any

import hpack

import rankgate
from rankgate.mocker import h2_connection, h2server
from rankgate.sidecar import grpc_call, http2
from rankgate.sidecar.inference_client import GENERATE_STREAM
from rankgate.wire.grpc_frame import grpc_message
from rankgate.wire.proto.vllm import inference_pb2

_HEAD = struct.Struct(">HBBBL")
_TOKEN = inference_pb2.GenerateResponse(
    outputs=inference_pb2.SequenceOutput(text=" tok", token_ids=[1234])
).SerializeToString()


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def write(self, data: Any) -> None:
        self.written += len(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return _HEAD.pack(len(payload) >> 8, len(payload) & 0xFF, kind, flags, stream_id) + payload


def _client(messages: int, batch: int) -> float:
    """Seconds for ``messages`` messages through the client's receive path."""
    conn = http2.Connection(64 << 20, lambda _: None, lambda *_: None)
    conn.connection_made(_Transport())
    headers = grpc_call.request_headers("http", "engine", GENERATE_STREAM)
    call: Any = grpc_call.Call(inference_pb2.GenerateResponse.FromString)
    conn.start(call, headers, grpc_message(b""))
    conn.data_received(_frame(4, 0, 0, b""))
    ok = b"\x88" + b"\x5f\x10application/grpc"
    conn.data_received(_frame(1, 4, 1, ok))
    data = _frame(0, 0, 1, grpc_message(_TOKEN))
    chunk = data * batch
    take = call._next
    rounds = messages // batch
    start = time.perf_counter()
    for _ in range(rounds):
        conn.data_received(chunk)
        for _ in range(batch):
            take()
    return time.perf_counter() - start


def _requests(count: int) -> float:
    """Seconds for ``count`` whole unary calls through the client: the request's frames out,
    the response's headers, one message and the trailers in, the reply taken."""
    conn = http2.Connection(64 << 20, lambda _: None, lambda *_: None)
    conn.connection_made(_Transport())
    conn.data_received(_frame(4, 0, 0, b"") + _frame(8, 0, 0, struct.pack(">L", 1 << 30)))
    headers = grpc_call.request_headers("http", "engine", GENERATE_STREAM)
    body = grpc_message(b"\x0a\x01r" * 20)
    encoder = hpack.Encoder()
    message = grpc_message(_TOKEN)
    parse = inference_pb2.GenerateResponse.FromString

    def call(sid: int, ok: bytes, done: bytes) -> None:
        unary: Any = grpc_call.UnaryCall(parse)
        conn.start(unary, headers, body)
        conn.data_received(
            _frame(1, 4, sid, ok) + _frame(0, 0, sid, message) + _frame(1, 5, sid, done)
        )
        if unary._next() is None:
            raise RuntimeError("the call got no reply")

    # The first response indexes its fields; every later one is all indexed, as vLLM's are.
    response = [(":status", "200"), ("content-type", "application/grpc")]
    call(1, encoder.encode(response), encoder.encode([("grpc-status", "0")]))
    ok, done = encoder.encode(response), encoder.encode([("grpc-status", "0")])
    start = time.perf_counter()
    for i in range(1, count + 1):
        call(2 * i + 1, ok, done)
    return time.perf_counter() - start


def _server(messages: int) -> float:
    """Seconds for ``messages`` messages through the server's send path."""
    server = h2server.H2Server(max_message=64 << 20)
    server.add_registered_method_handlers("vllm.Inference", {"GenerateStream": _Handler()})
    conn = h2_connection.Connection(server)
    conn.connection_made(_Transport())
    block = hpack.Encoder().encode(
        [(":method", "POST"), (":path", GENERATE_STREAM), ("content-type", "application/grpc")]
    )
    grant = _frame(8, 0, 0, struct.pack(">L", 1 << 30)) + _frame(
        4, 0, 0, struct.pack(">HL", 4, (1 << 31) - 1)
    )
    conn.data_received(_PREFACE)
    conn.data_received(_frame(4, 0, 0, b"") + grant + _frame(1, 4, 1, block))
    streams = getattr(conn, "streams", None) or getattr(conn, "_streams", {})
    stream = streams[1]
    stream.headers_sent = True
    queue = conn._queue_message
    flush = conn._flush
    start = time.perf_counter()
    for i in range(messages):
        queue(stream, _TOKEN)
        if i % 4 == 3:
            flush()
    flush()
    return time.perf_counter() - start


class _Handler:
    request_streaming = False
    response_streaming = True
    request_deserializer = staticmethod(inference_pb2.GenerateRequest.FromString)
    response_serializer = staticmethod(bytes)

    async def unary_stream(self, request: Any, context: Any) -> Any:
        yield request


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--once", type=int, default=0, help="run each path N times, once")
    parser.add_argument("--path", choices=("client", "requests", "server", "all"), default="all")
    args = parser.parse_args()
    asyncio.run(_measure(args))


async def _measure(args: argparse.Namespace) -> None:
    # Inside a running loop, as the roles expect; nothing here ever yields to it.
    if args.once:
        if args.path in ("client", "all"):
            _client(args.once, args.batch)
        if args.path in ("requests", "all"):
            _requests(args.once)
        if args.path in ("server", "all"):
            _server(args.once)
        return
    client = min(_client(args.messages, args.batch) for _ in range(args.repeats))
    requests = min(_requests(args.messages // 4) for _ in range(args.repeats))
    server = min(_server(args.messages) for _ in range(args.repeats))
    print(f"checkout: {rankgate.__file__.rsplit('/rankgate/', 1)[0]}")
    print(f"client receive: {client / args.messages * 1e9:7.0f} ns/message (batch {args.batch})")
    print(f"client request: {requests / (args.messages // 4) * 1e9:7.0f} ns/unary call")
    print(f"server send:    {server / args.messages * 1e9:7.0f} ns/message")


if __name__ == "__main__":
    main()
