"""The lean HTTP/2 gRPC client (``rankgate.sidecar.http2`` behind
``rankgate.sidecar.inference_client``).

Against grpcio's own server: flow control both ways with messages far larger than the default
windows, hundreds of concurrent streams, a peer stream limit, status codes with escaped
messages, cancellation reaching the server, size limits and reconnection after a restart.
Against a scripted raw HTTP/2 peer: padding, CONTINUATION, Huffman-coded headers, Trailers-Only
replies, HTTP errors, RST_STREAM, GOAWAY, compressed messages and PING answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import hpack
import pytest

from rankgate.sidecar import grpc_call, http2
from rankgate.sidecar.convert import merge_responses
from rankgate.sidecar.endpoint import parse_endpoint
from rankgate.sidecar.errors import (
    BadEngineResponse,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    InvalidRequest,
    NotFound,
    SidecarError,
)
from rankgate.sidecar.inference_client import InferenceClient
from rankgate.wire.grpc_frame import grpc_message
from rankgate.wire.h2 import frames
from rankgate.wire.h2.headers import HeaderDecoder
from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc
from tests.sidecar.fake_vllm import token_step
from tests.support.polling import until
from tests.support.ports import free_port

MAX_MESSAGE = 64 << 20
# The scripted peer reads the client's frames only between its replies: wait as long as a
# loaded machine takes, and fail with a clear message well before the test's timeout.
PEER_READS_S = 60


def _request(request_id: str = "r", prompt: int = 4, tokens: int = 3) -> Any:
    return inference_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=inference_pb2.TokenIds(ids=range(prompt)),
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=tokens),
    )


class _Echo(inference_pb2_grpc.InferenceServicer):
    """Generate answers the prompt length and ``max_new_tokens`` characters of text; the
    stream sends one token per message. Special request ids trigger errors."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        # The request id of each call that reached a handler, in order.
        self.received: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def Generate(self, request: Any, context: Any) -> Any:
        await self._check(request, context)
        await self.gate.wait()
        return inference_pb2.GenerateResponse(
            prompt_info=inference_pb2.PromptInfo(num_prompt_tokens=len(request.token_ids.ids)),
            outputs=inference_pb2.SequenceOutput(
                text="x" * request.stopping.max_new_tokens,
                finish_info=inference_pb2.FinishInfo(finish_reason=inference_pb2.FinishInfo.LENGTH),
            ),
        )

    async def GenerateStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        await self._check(request, context)
        try:
            yield inference_pb2.GenerateResponse(
                prompt_info=inference_pb2.PromptInfo(num_prompt_tokens=len(request.token_ids.ids))
            )
            for i in range(request.stopping.max_new_tokens):
                if request.request_id.startswith("slow"):
                    await token_step()
                yield inference_pb2.GenerateResponse(
                    outputs=inference_pb2.SequenceOutput(text=f"t{i}", token_ids=[i])
                )
            if request.request_id == "fail-late":
                await context.abort(grpc.StatusCode.INTERNAL, "engine core died")
        except (asyncio.CancelledError, GeneratorExit):
            # A cancel that lands while grpcio sends a message stops its handler outside the
            # generator, which is then closed (GeneratorExit) rather than cancelled.
            self.cancelled.append(request.request_id)
            raise

    async def _check(self, request: Any, context: Any) -> None:
        self.received.append(request.request_id)
        if request.request_id == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad: 100% wrong\nreally ✗")
        if request.request_id == "busy":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests")


class _GrpcServer:
    def __init__(self, options: tuple[tuple[str, Any], ...] = ()) -> None:
        self.echo = _Echo()
        self.port = free_port()
        self.options = (
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            *options,
        )
        self.server: Any = None

    async def start(self) -> None:
        self.server = grpc.aio.server(options=self.options)
        add: Any = inference_pb2_grpc.add_InferenceServicer_to_server
        add(self.echo, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(grace=None)


@contextlib.asynccontextmanager
async def _grpc_server(*options: tuple[str, Any]) -> AsyncIterator[tuple[_GrpcServer, Any]]:
    server = _GrpcServer(options)
    await server.start()
    client = InferenceClient(parse_endpoint(f"127.0.0.1:{server.port}"), MAX_MESSAGE)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()


async def _all(call: Any) -> list[Any]:
    return [message async for message in call]


def _tokens(messages: list[Any]) -> list[int]:
    return [token for message in messages for token in message.outputs.token_ids]


async def test_unary_and_stream_replies() -> None:
    async with _grpc_server() as (_, client):
        reply = await client.Generate(_request(prompt=7, tokens=5))
        assert reply.prompt_info.num_prompt_tokens == 7
        assert reply.outputs.text == "xxxxx"
        messages = await _all(client.GenerateStream(_request(tokens=4)))
        assert messages[0].HasField("prompt_info")
        assert "".join(m.outputs.text for m in messages) == "t0t1t2t3"
        assert _tokens(messages) == [0, 1, 2, 3]
        call = client.GenerateStream(_request(tokens=1))
        await _all(call)
        assert await call.read() is None


async def test_messages_far_beyond_the_flow_control_windows() -> None:
    """A 4 MB request (default send window 64 KiB) and an 8 MB reply (our stream window is
    4 MiB): both must wait for and grant WINDOW_UPDATEs to get through."""
    async with _grpc_server() as (_, client):
        reply = await client.Generate(_request(prompt=1_000_000, tokens=8 << 20))
        assert reply.prompt_info.num_prompt_tokens == 1_000_000
        assert len(reply.outputs.text) == 8 << 20


async def test_hundreds_of_concurrent_streams_on_one_connection() -> None:
    async with _grpc_server() as (_, client):
        calls = [client.GenerateStream(_request(f"c{i}", tokens=20)) for i in range(300)]
        results = await asyncio.gather(*(_all(c) for c in calls))
        assert all(_tokens(r) == list(range(20)) for r in results)
        assert all(r[0].prompt_info.num_prompt_tokens == 4 for r in results)


async def test_the_peer_stream_limit_queues_calls() -> None:
    async with _grpc_server(("grpc.max_concurrent_streams", 2)) as (_, client):
        await client.Generate(_request())  # learn the peer's SETTINGS
        calls = [client.GenerateStream(_request(f"slow{i}", tokens=5)) for i in range(12)]
        results = await asyncio.gather(*(_all(c) for c in calls))
        assert all(_tokens(r) == list(range(5)) for r in results)


async def test_status_codes_and_escaped_messages() -> None:
    async with _grpc_server() as (_, client):
        with pytest.raises(InvalidRequest) as caught:
            await client.Generate(_request("invalid"))
        assert caught.value.message == "bad: 100% wrong\nreally ✗"
        with pytest.raises(EngineOverloaded, match="too many requests"):
            await _all(client.GenerateStream(_request("busy")))


async def test_messages_before_a_late_error_are_delivered_first() -> None:
    async with _grpc_server() as (_, client):
        call = client.GenerateStream(_request("fail-late", tokens=3))
        received = [await call.read() for _ in range(4)]
        assert [m.outputs.text for m in received[1:]] == ["t0", "t1", "t2"]
        with pytest.raises(EngineFailure, match=r"\(INTERNAL\): engine core died"):
            await call.read()


async def test_cancel_reaches_the_server_and_the_reader() -> None:
    async with _grpc_server() as (server, client):
        call = client.GenerateStream(_request("slow-cancel", tokens=1000))
        await call.read()
        reader = asyncio.ensure_future(call.read())
        await asyncio.sleep(0)
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert call.cancelled()
        assert not call.cancel()
        await until(lambda: server.echo.cancelled, PEER_READS_S, "the cancel reaches the engine")
        assert server.echo.cancelled == ["slow-cancel"]
        # The connection stays usable.
        assert (await client.Generate(_request(tokens=2))).outputs.text == "xx"


async def test_a_cancelled_unary_call_raises_cancelled() -> None:
    async with _grpc_server() as (server, client):
        server.echo.gate.clear()
        call = client.Generate(_request())
        waiter = asyncio.ensure_future(call)
        await until(lambda: server.echo.received == ["r"], 10, "the call reaches the engine")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter


async def test_message_size_limits() -> None:
    async with _grpc_server() as (server, _):
        small = InferenceClient(parse_endpoint(f"127.0.0.1:{server.port}"), 1000)
        try:
            with pytest.raises(BadEngineResponse, match=r"engine message of .* exceeds 1000"):
                await small.Generate(_request(tokens=5000))
            with pytest.raises(EngineOverloaded, match=r"request of .* exceeds 1000"):
                await small.Generate(_request(prompt=2000))
            assert (await small.Generate(_request(tokens=10))).outputs.text == "x" * 10
        finally:
            await small.close()


async def test_engine_down_then_restarted() -> None:
    server = _GrpcServer()
    client = InferenceClient(parse_endpoint(f"127.0.0.1:{server.port}"), MAX_MESSAGE)
    try:
        with pytest.raises(EngineUnavailable, match="cannot connect"):
            await client.Generate(_request())
        await server.start()
        assert (await client.Generate(_request(tokens=1))).outputs.text == "x"
        call = client.GenerateStream(_request("slow-down", tokens=1000))
        await call.read()
        await server.stop()
        with pytest.raises(EngineUnavailable):
            await _all(call)
        server.server = None
        await server.start()
        assert (await client.Generate(_request(tokens=2))).outputs.text == "xx"
    finally:
        await client.close()
        if server.server is not None:
            await server.stop()
    with pytest.raises(EngineUnavailable, match="closed"):
        await client.Generate(_request())


# ---------------------------------------------------------------- a scripted raw peer

Frames = list[tuple[int, int, int, bytes]]
Script = Callable[["_Peer", int, str], Awaitable[None]]
_HEAD = struct.Struct(">HBBBL")


class _Peer:
    """A raw HTTP/2 server: reads the client's frames, and answers each request (HEADERS, then
    DATA up to END_STREAM) by running ``script`` with its stream id and request id."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.encoder = hpack.Encoder()
        self.received: Frames = []
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.connections = 0
        # The request id of each request the script was run for, in order.
        self.requests: list[str] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        bodies: dict[int, bytes] = {}
        try:
            assert await reader.readexactly(24) == frames.PREFACE
            writer.write(frames.frame(frames.SETTINGS, 0, 0))
            while True:
                kind, flags, stream_id, payload = await self._read_frame()
                if kind == frames.DATA:
                    body = bodies.pop(stream_id, b"") + payload
                    if flags & frames.END_STREAM:
                        request = inference_pb2.GenerateRequest.FromString(body[5:])
                        self.requests.append(request.request_id)
                        await self.script(self, stream_id, request.request_id)
                    else:
                        bodies[stream_id] = body
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _read_frame(self) -> tuple[int, int, int, bytes]:
        assert self.reader is not None
        hi, lo, kind, flags, stream_id = _HEAD.unpack(await self.reader.readexactly(9))
        frame = (kind, flags, stream_id, await self.reader.readexactly((hi << 8) | lo))
        self.received.append(frame)
        return frame

    async def round_trip(self) -> None:
        """Send a PING and read until its ACK: the client has then handled every frame sent
        before it, and its reader has woken whoever waits on them."""
        assert self.writer is not None
        self.send(frames.PING, 0, 0, _PROBE)
        await self.writer.drain()
        while True:
            kind, _, _, payload = await self._read_frame()
            if kind == frames.PING and payload == _PROBE:
                return

    def send(self, kind: int, flags: int, stream_id: int, payload: bytes = b"") -> None:
        assert self.writer is not None
        self.writer.write(frames.frame(kind, flags, stream_id, payload))

    def headers(self, pairs: list[tuple[str, str]], huffman: bool = True) -> bytes:
        return bytes(self.encoder.encode(pairs, huffman=huffman))

    def reply(self, stream_id: int, *messages: bytes, status: int = 0, message: str = "") -> None:
        self.send(frames.HEADERS, frames.END_HEADERS, stream_id, self.headers(_OK))
        for payload in messages:
            self.send(frames.DATA, 0, stream_id, grpc_message(payload))
        trailers = [("grpc-status", str(status))] + ([("grpc-message", message)] if message else [])
        self.send(
            frames.HEADERS,
            frames.END_HEADERS | frames.END_STREAM,
            stream_id,
            self.headers(trailers),
        )


_OK = [(":status", "200"), ("content-type", "application/grpc")]
_PROBE = b"probe!!!"
_TOKEN = inference_pb2.GenerateResponse(
    outputs=inference_pb2.SequenceOutput(text="tok", token_ids=[7])
).SerializeToString()


@contextlib.asynccontextmanager
async def _peer(script: Script) -> AsyncIterator[tuple[_Peer, InferenceClient]]:
    peer = _Peer(script)
    server = await asyncio.start_server(peer.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = InferenceClient(parse_endpoint(f"127.0.0.1:{port}"), MAX_MESSAGE)
    try:
        yield peer, client
    finally:
        await client.close()
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


async def _code_of(call: Any) -> tuple[type[SidecarError], str]:
    """The error type a call ended with, and the gRPC status its message names."""
    with pytest.raises(SidecarError) as caught:
        await _all(call)
    named = caught.value.message.partition("(")[2].partition(")")[0]
    return type(caught.value), named


async def test_padding_continuation_and_split_messages() -> None:
    async def script(peer: _Peer, sid: int, rid: str) -> None:
        block = peer.headers(_OK)
        # HEADERS padded and with priority, its block split across a CONTINUATION.
        priority = b"\x00\x00\x00\x00\x10"
        peer.send(frames.HEADERS, frames.PADDED | frames.PRIORITY_FLAG, sid,
                  b"\x03" + priority + block[:1] + b"pad")  # fmt: skip
        peer.send(frames.CONTINUATION, frames.END_HEADERS, sid, block[1:])
        # One message split over three DATA frames, the middle one padded; then two in one.
        one = grpc_message(_TOKEN)
        peer.send(frames.DATA, 0, sid, one[:3])
        peer.send(frames.DATA, frames.PADDED, sid, b"\x02" + one[3:9] + b"\x00\x00")
        peer.send(frames.DATA, 0, sid, one[9:])
        peer.send(frames.DATA, 0, sid, one + one)
        peer.send(
            frames.HEADERS,
            frames.END_HEADERS | frames.END_STREAM,
            sid,
            peer.headers([("grpc-status", "0")], huffman=False),
        )

    async with _peer(script) as (_, client):
        messages = await _all(client.GenerateStream(_request()))
        assert _tokens(messages) == [7, 7, 7]
        assert "".join(m.outputs.text for m in messages) == "toktoktok"


def _message(**fields: Any) -> bytes:
    prompt = fields.pop("prompt", None)
    response = inference_pb2.GenerateResponse(outputs=inference_pb2.SequenceOutput(**fields))
    if prompt is not None:
        response.prompt_info.num_prompt_tokens = prompt
    return bytes(response.SerializeToString())


async def test_messages_already_waiting_are_merged_into_one() -> None:
    """A reader that fell behind gets everything waiting at once, nothing lost; the messages
    of a request that asked for logprobs are left whole."""
    finish = inference_pb2.FinishInfo(finish_reason=inference_pb2.FinishInfo.LENGTH)
    finish.num_output_tokens = 4

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        if rid == "many":
            peer.reply(sid, *(_message(text="x", token_ids=[i]) for i in range(40)))
        elif rid == "plain":
            peer.reply(
                sid,
                _message(prompt=9),
                *(_message(text=f"t{i}", token_ids=[i], num_tokens=1) for i in range(3)),
                _message(text="!", token_ids=[3], num_tokens=1, finish_info=finish),
            )
        else:
            peer.reply(
                sid,
                _message(text="a", token_ids=[1], logprobs=[-0.5]),
                _message(text="b", token_ids=[2], logprobs=[-1.5]),
            )

    async with _peer(script) as (_, client):
        first = await _all(client.GenerateStream(_request("plain")))
        assert len(first) == 1
        far_behind = await _all(client.GenerateStream(_request("many")))
        assert _tokens(far_behind) == list(range(40))
        assert all(len(m.outputs.token_ids) <= grpc_call.MAX_MERGED + 1 for m in far_behind)
        merged = first[0]
        assert merged.prompt_info.num_prompt_tokens == 9
        assert list(merged.outputs.token_ids) == [0, 1, 2, 3]
        assert merged.outputs.text == "t0t1t2!"
        assert merged.outputs.num_tokens == 4
        assert merged.outputs.finish_info == finish
        asks = _request("logprobs")
        asks.response.output_logprobs = True
        logprobs = await _all(client.GenerateStream(asks))
        assert [list(m.outputs.logprobs) for m in logprobs] == [[-0.5], [-1.5]]


async def test_one_read_merges_at_most_max_merged_more() -> None:
    conn = http2.Connection(MAX_MESSAGE, lambda _: None, lambda *_: None)
    call = grpc_call.Call(inference_pb2.GenerateResponse.FromString, merge_responses)
    call.conn = conn
    call.on_headers(_OK, end_stream=False)
    data = b"".join(grpc_message(_message(token_ids=[i])) for i in range(40))
    call.on_data(data, len(data), False)
    call.on_headers([("grpc-status", "0")], end_stream=True)
    reads = [await call.read() for _ in range(3)]
    assert [list(m.outputs.token_ids) for m in reads[:2] if m is not None] == [
        list(range(grpc_call.MAX_MERGED + 1)),
        list(range(grpc_call.MAX_MERGED + 1, 40)),
    ]
    assert reads[2] is None


async def test_a_declined_merge_hands_the_messages_out_in_order() -> None:
    call = grpc_call.Call(inference_pb2.GenerateResponse.FromString, merge_responses)
    call.conn = http2.Connection(MAX_MESSAGE, lambda _: None, lambda *_: None)
    call.on_headers(_OK, end_stream=False)
    finish = inference_pb2.FinishInfo(finish_reason=inference_pb2.FinishInfo.LENGTH)
    # Nothing may follow a finish, so these three are not merged.
    data = b"".join(
        grpc_message(payload)
        for payload in (
            _message(text="a", token_ids=[1]),
            _message(text="b", token_ids=[2], finish_info=finish),
            _message(text="c", token_ids=[3]),
        )
    )
    call.on_data(data, len(data), False)
    call.on_headers([("grpc-status", "0")], end_stream=True)
    assert [m.outputs.text for m in [await call.read() for _ in range(3)] if m] == ["a", "b", "c"]
    assert await call.read() is None


async def test_a_reader_that_keeps_up_gets_every_message_as_sent() -> None:
    async with _grpc_server() as (_, client):
        messages = await _all(client.GenerateStream(_request("slow", tokens=5)))
        assert [m.outputs.text for m in messages[1:]] == ["t0", "t1", "t2", "t3", "t4"]


async def test_trailers_only_and_http_errors() -> None:
    async def script(peer: _Peer, sid: int, rid: str) -> None:
        if rid == "trailers-only":
            pairs = [*_OK, ("grpc-status", "5"), ("grpc-message", "model%20missing")]
            peer.send(
                frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, sid, peer.headers(pairs)
            )
        elif rid == "http-503":
            peer.send(
                frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, sid,
                peer.headers([(":status", "503")]),
            )  # fmt: skip
        elif rid == "no-trailers":
            peer.send(frames.HEADERS, frames.END_HEADERS, sid, peer.headers(_OK))
            peer.send(frames.DATA, frames.END_STREAM, sid, grpc_message(_TOKEN))
        else:
            peer.reply(sid, _TOKEN, status=99)

    async with _peer(script) as (_, client):
        with pytest.raises(NotFound) as caught:
            await client.Generate(_request("trailers-only"))
        assert caught.value.message == "model missing"
        code = await _code_of(client.GenerateStream(_request("http-503")))
        assert code == (EngineUnavailable, "UNAVAILABLE")
        code = await _code_of(client.GenerateStream(_request("no-trailers")))
        assert code == (EngineFailure, "INTERNAL")
        code = await _code_of(client.GenerateStream(_request("unknown-status")))
        assert code == (EngineFailure, "UNKNOWN")


async def test_unary_reply_shapes() -> None:
    async def script(peer: _Peer, sid: int, rid: str) -> None:
        if rid == "none":
            peer.reply(sid)
        else:
            peer.reply(sid, _TOKEN, _TOKEN)

    async with _peer(script) as (_, client):
        with pytest.raises(EngineFailure, match="no reply"):
            await client.Generate(_request("none"))
        with pytest.raises(EngineFailure, match="more than one reply"):
            await client.Generate(_request("two"))


async def test_a_unary_reply_is_settled_by_trailers_that_come_after_it() -> None:
    """The reply alone is not the answer when the trailers are still to come: an error status
    in them fails the call, and another message before them is a second reply."""

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        assert peer.writer is not None
        peer.send(frames.HEADERS, frames.END_HEADERS, sid, peer.headers(_OK))
        peer.send(frames.DATA, 0, sid, grpc_message(_TOKEN))
        # Past the client's read of the reply, so the trailers arrive in a read of their own.
        await peer.round_trip()
        if rid == "then-another":
            peer.send(frames.DATA, 0, sid, grpc_message(_TOKEN))
        status = "13" if rid == "then-error" else "0"
        trailers = peer.headers([("grpc-status", status)])
        peer.send(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, sid, trailers)

    async with _peer(script) as (_, client):
        reply = await client.Generate(_request("then-ok"))
        assert list(reply.outputs.token_ids) == [7]
        with pytest.raises(EngineFailure, match="INTERNAL"):
            await client.Generate(_request("then-error"))
        with pytest.raises(EngineFailure, match="more than one reply"):
            await client.Generate(_request("then-another"))


async def test_replies_outside_the_contract_are_bad_engine_responses() -> None:
    """A compressed, oversized or unparsable message is the engine breaking the contract, not
    the engine being busy: BadEngineResponse (never EngineOverloaded, which other ranks would
    be asked to retry), and the engine is told to stop the stream."""

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        peer.send(frames.HEADERS, frames.END_HEADERS, sid, peer.headers(_OK))
        if rid == "compressed":
            peer.send(frames.DATA, 0, sid, b"\x01" + struct.pack(">L", 1) + b"z")
        elif rid == "huge":
            peer.send(frames.DATA, 0, sid, b"\x00" + struct.pack(">L", MAX_MESSAGE + 1) + b"z")
        elif rid == "garbage":
            junk = b"\xff" * 7
            peer.send(frames.DATA, 0, sid, b"\x00" + struct.pack(">L", len(junk)) + junk)
        else:
            peer.send(
                frames.RST_STREAM, 0, sid, struct.pack(">L", frames.ErrorCode.ENHANCE_YOUR_CALM)
            )

    async with _peer(script) as (peer, client):
        for rid in ("compressed", "huge", "garbage"):
            with pytest.raises(BadEngineResponse):
                await _all(client.GenerateStream(_request(rid)))
        with pytest.raises(BadEngineResponse, match="does not parse"):
            await client.Generate(_request("garbage"))
        assert (await _code_of(client.GenerateStream(_request("calm"))))[0] is EngineOverloaded
        # We told the peer to stop streams 1 to 7 (CANCEL), never 9 (reset by the peer).
        await until(lambda: len(_resets(peer)) >= 4, PEER_READS_S, lambda: f"{_resets(peer)}")
        resets = [sid for kind, _, sid, _ in peer.received if kind == frames.RST_STREAM]
        assert resets == [1, 3, 5, 7]


async def test_refused_streams_are_sent_again_a_bounded_number_of_times() -> None:
    tries: dict[str, int] = {}

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        tries[rid] = tries.get(rid, 0) + 1
        if rid == "always" or tries[rid] == 1:
            peer.send(frames.RST_STREAM, 0, sid, struct.pack(">L", frames.ErrorCode.REFUSED_STREAM))
        else:
            peer.reply(sid, _TOKEN)

    async with _peer(script) as (_, client):
        assert len(await _all(client.GenerateStream(_request("once")))) == 1
        assert tries["once"] == 2
        code = await _code_of(client.GenerateStream(_request("always")))
        assert code == (EngineUnavailable, "UNAVAILABLE")
        assert tries["always"] == http2.MAX_TRIES + 1


async def test_goaway_moves_untaken_streams_to_a_new_connection() -> None:
    async def script(peer: _Peer, sid: int, rid: str) -> None:
        if rid == "second" and peer.connections == 1:
            # Stream 1 ("first") is still open and was taken; stream 3 was not.
            peer.send(frames.GOAWAY, 0, 0, struct.pack(">LL", 1, 0))
            peer.reply(1, _TOKEN)
        elif rid != "first":
            peer.reply(sid, _TOKEN, _TOKEN)

    async with _peer(script) as (peer, client):
        first = client.GenerateStream(_request("first"))
        await until(lambda: peer.requests == ["first"], 10, lambda: f"requests: {peer.requests}")
        second = client.GenerateStream(_request("second"))
        assert _tokens(await _all(second)) == [7, 7]
        assert _tokens(await _all(first)) == [7]
        assert _tokens(await _all(client.GenerateStream(_request("third")))) == [7, 7]
        assert peer.connections == 2


async def test_pings_are_answered_and_settings_acknowledged() -> None:
    async def script(peer: _Peer, sid: int, rid: str) -> None:
        peer.send(frames.PING, 0, 0, b"12345678")
        peer.send(frames.SETTINGS, 0, 0, struct.pack(">HL", frames.SETTINGS_MAX_FRAME_SIZE, 20000))
        peer.reply(sid, _TOKEN)

    async with _peer(script) as (peer, client):
        await _all(client.GenerateStream(_request()))
        # The answers were sent before the reply was read; the peer reads them after it.
        await until(lambda: len(_pings(peer)) + len(_settings_acks(peer)) >= 2, 10, "the answers")
    assert _pings(peer) == [(frames.ACK, b"12345678")]
    assert _settings_acks(peer)


def _pings(peer: _Peer) -> list[tuple[int, bytes]]:
    return [(flags, payload) for kind, flags, _, payload in peer.received if kind == frames.PING]


def _settings_acks(peer: _Peer) -> list[int]:
    return [
        flags
        for kind, flags, _, _ in peer.received
        if kind == frames.SETTINGS and flags & frames.ACK
    ]


async def test_a_silent_peer_is_dropped_by_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http2, "KEEPALIVE_S", 0.05)
    monkeypatch.setattr(http2, "KEEPALIVE_TIMEOUT_S", 0.05)

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        peer.send(frames.HEADERS, frames.END_HEADERS, sid, peer.headers(_OK))

    async with _peer(script) as (peer, client):
        peer_ignores_pings = client.GenerateStream(_request())
        code = await asyncio.wait_for(_code_of(peer_ignores_pings), 5)
        assert code == (EngineUnavailable, "UNAVAILABLE")
    assert any(kind == frames.PING for kind, _, _, _ in peer.received)


def test_the_header_memo_follows_the_dynamic_table() -> None:
    """An indexed-only block is remembered until a block changes the table: then the same
    bytes name a different entry and must be decoded again."""
    encoder = hpack.Encoder()
    decoder = HeaderDecoder()
    assert decoder.decode(encoder.encode([("a", "1")])) == [("a", "1")]
    indexed = encoder.encode([("a", "1")])
    assert indexed == b"\xbe"
    assert decoder.decode(indexed) == [("a", "1")]
    assert decoder.decode(indexed) == [("a", "1")]
    assert decoder.decode(encoder.encode([("b", "2")])) == [("b", "2")]
    # Entry 62 is now b=2 (a=1 moved to 63): the memo must not answer a=1.
    assert decoder.decode(b"\xbe") == [("b", "2")]
    assert decoder.decode(b"\xbf\x88") == [("a", "1"), (":status", "200")]
    # Literals that are not indexed (plain and Huffman-coded) leave the table alone: they are
    # remembered, and what was remembered stays valid.
    plain = b"\x00\x0cgrpc-message\x00"
    assert decoder.decode(plain) == [("grpc-message", "")]
    secret = encoder.encode([hpack.NeverIndexedHeaderTuple("key", "x" * 200)])
    assert decoder.decode(secret) == [("key", "x" * 200)]
    assert decoder.decode(b"\xbe") == [("b", "2")]
    assert decoder._memo.keys() >= {plain, secret, b"\xbe"}
    # A table size update changes the table: everything is forgotten.
    assert decoder.decode(b"\x3f\xe1\x1f\xbe") == [("b", "2")]
    assert not decoder._memo


# ---------------------------------------------------------------- what RFC 9113 forbids


def _goaways(peer: _Peer) -> list[int]:
    """The error codes of the GOAWAY frames the client sent."""
    return [
        struct.unpack(">LL", payload[:8])[1]
        for kind, _, _, payload in peer.received
        if kind == frames.GOAWAY
    ]


def _resets(peer: _Peer) -> list[tuple[int, int]]:
    return [
        (sid, struct.unpack(">L", payload)[0])
        for kind, _, sid, payload in peer.received
        if kind == frames.RST_STREAM
    ]


async def _refused_with(script: Script, code: frames.ErrorCode, words: str) -> _Peer:
    """Run one call against ``script``: it must fail with an EngineFailure naming ``words``
    and the client must end the connection with GOAWAY(``code``); the next call gets a new
    connection."""
    async with _peer(script) as (peer, client):
        with pytest.raises(EngineFailure, match=words) as caught:
            await _all(client.GenerateStream(_request()))
        assert code.name in caught.value.message
        await until(lambda: _goaways(peer), PEER_READS_S, "a GOAWAY from the client")
        assert _goaways(peer) == [code]
        return peer


async def test_a_continuation_flood_is_refused() -> None:
    """A header block that never ends: 16 MiB of CONTINUATION is cut off at the limit."""

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        assert peer.writer is not None
        peer.send(frames.HEADERS, 0, sid, peer.headers(_OK))
        chunk = b"\x00" * frames.DEFAULT_MAX_FRAME
        with contextlib.suppress(ConnectionError):
            for _ in range(1024):
                peer.send(frames.CONTINUATION, 0, sid, chunk)
                await peer.writer.drain()

    # The client closes a connection with 16 MiB unread: its GOAWAY may die with the reset.
    async with _peer(script) as (_, client):
        with pytest.raises(EngineFailure, match=r"ENHANCE_YOUR_CALM.*header block too large"):
            await _all(client.GenerateStream(_request()))
        assert client._conn is None


async def test_data_inside_an_open_header_block_is_refused() -> None:
    async def script(peer: _Peer, sid: int, rid: str) -> None:
        block = peer.headers(_OK)
        peer.send(frames.HEADERS, 0, sid, block[:1])
        peer.send(frames.DATA, 0, sid, grpc_message(_TOKEN))
        peer.send(frames.CONTINUATION, frames.END_HEADERS, sid, block[1:])

    await _refused_with(script, frames.ErrorCode.PROTOCOL_ERROR, "header block was interrupted")


async def test_an_initial_window_of_2_to_the_31_is_refused() -> None:
    async def script(peer: _Peer, sid: int, rid: str) -> None:
        setting = struct.pack(">HL", frames.SETTINGS_INITIAL_WINDOW_SIZE, 1 << 31)
        peer.send(frames.SETTINGS, 0, 0, setting)
        peer.reply(sid, _TOKEN)

    await _refused_with(
        script, frames.ErrorCode.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above"
    )


async def test_a_window_update_of_zero_is_refused() -> None:
    """On a stream it is a stream error (RST_STREAM, the connection goes on); on the
    connection a connection error."""

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        if rid == "stream":
            peer.send(frames.WINDOW_UPDATE, 0, sid, struct.pack(">L", 0))
        elif rid == "connection":
            peer.send(frames.WINDOW_UPDATE, 0, 0, struct.pack(">L", 0))
        else:
            peer.reply(sid, _TOKEN)

    async with _peer(script) as (peer, client):
        with pytest.raises(EngineFailure, match=r"PROTOCOL_ERROR.*WINDOW_UPDATE of 0"):
            await _all(client.GenerateStream(_request("stream")))
        await until(lambda: _resets(peer), PEER_READS_S, "a RST_STREAM from the client")
        assert _resets(peer) == [(1, frames.ErrorCode.PROTOCOL_ERROR)]
        assert _tokens(await _all(client.GenerateStream(_request("fine")))) == [7]
        assert peer.connections == 1
        with pytest.raises(EngineFailure, match="WINDOW_UPDATE of 0 on the connection"):
            await _all(client.GenerateStream(_request("connection")))
        await until(lambda: _goaways(peer), PEER_READS_S, "a GOAWAY from the client")
        assert _goaways(peer) == [frames.ErrorCode.PROTOCOL_ERROR]


async def test_a_send_window_past_2_to_the_31_minus_1_is_refused() -> None:
    async def script(peer: _Peer, sid: int, rid: str) -> None:
        grow = struct.pack(">L", frames.MAX_WINDOW)
        if rid == "stream":
            peer.send(frames.WINDOW_UPDATE, 0, sid, grow)
        elif rid == "connection":
            peer.send(frames.WINDOW_UPDATE, 0, 0, grow)
        else:
            peer.reply(sid, _TOKEN)

    async with _peer(script) as (peer, client):
        with pytest.raises(EngineFailure, match=r"FLOW_CONTROL_ERROR.*stream window above"):
            await _all(client.GenerateStream(_request("stream")))
        await until(lambda: _resets(peer), PEER_READS_S, "a RST_STREAM from the client")
        assert _resets(peer) == [(1, frames.ErrorCode.FLOW_CONTROL_ERROR)]
        assert _tokens(await _all(client.GenerateStream(_request("fine")))) == [7]
        with pytest.raises(EngineFailure, match="connection window above"):
            await _all(client.GenerateStream(_request("connection")))
        await until(lambda: _goaways(peer), PEER_READS_S, "a GOAWAY from the client")
        assert _goaways(peer) == [frames.ErrorCode.FLOW_CONTROL_ERROR]


async def test_a_frame_above_the_advertised_maximum_is_refused() -> None:
    """We never raise SETTINGS_MAX_FRAME_SIZE from its 16,384 default: 100 kB is too much."""

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        peer.send(frames.HEADERS, frames.END_HEADERS, sid, peer.headers(_OK))
        peer.send(frames.DATA, 0, sid, grpc_message(b"\x00" * 100_000))

    await _refused_with(
        script, frames.ErrorCode.FRAME_SIZE_ERROR, "a frame of 100005 bytes exceeds 16384"
    )


async def test_stream_ids_past_2_to_the_31_minus_1_take_a_new_connection() -> None:
    """The last odd id 2^31-1 is used, then the next call opens a new connection (stream 1
    there) and the old one says GOAWAY(NO_ERROR) and closes once its streams are done."""
    ids: list[tuple[int, int]] = []

    async def script(peer: _Peer, sid: int, rid: str) -> None:
        ids.append((peer.connections, sid))
        peer.reply(sid, _TOKEN)

    async with _peer(script) as (peer, client):
        assert _tokens(await _all(client.GenerateStream(_request()))) == [7]
        conn = client._conn
        assert conn is not None
        conn.next_stream_id = frames.MAX_STREAM_ID - 2
        for _ in range(3):
            assert _tokens(await _all(client.GenerateStream(_request()))) == [7]
        assert ids == [(1, 1), (1, frames.MAX_STREAM_ID - 2), (1, frames.MAX_STREAM_ID), (2, 1)]
        await until(lambda: _goaways(peer), PEER_READS_S, "a GOAWAY from the client")
        assert _goaways(peer) == [frames.ErrorCode.NO_ERROR]
        assert conn.transport is None or conn.transport.is_closing()
