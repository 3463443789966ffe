"""The in-loop HTTP/2 gRPC server (mocker.h2server) as clients meet it.

grpcio clients check interop and status parity with grpc.aio's server; a raw-socket client
drives what grpcio will not do on request: a tiny flow-control window, a request cut into
pieces, RST_STREAM, PING, a bad preface, a server-side deadline.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from rankgate.mocker.h2server import H2Server
from rankgate.wire.proto.vllm import control_pb2, inference_pb2
from tests.mocker.conftest import Client, engine, prompt, request
from tests.support.cyclic_garbage import cyclic_garbage
from tests.support.mock_engine import MockEngineHandle
from tests.support.polling import wait_until

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
FRAME = struct.Struct(">HBBBL")
PROBE = b"probe!!!"


@pytest.fixture(scope="module")
def inloop() -> Iterator[MockEngineHandle]:
    with engine(kv_events_port=None, kv_replay_port=None, max_model_len=65520) as handle:
        assert handle.config.grpc_server == "inloop"
        yield handle


@pytest.fixture(scope="module")
def grpcio() -> Iterator[MockEngineHandle]:
    with engine(kv_events_port=None, kv_replay_port=None, grpc_server="grpcio") as handle:
        yield handle


@pytest.fixture
def client(inloop: MockEngineHandle) -> Iterator[Client]:
    c = Client(inloop.target)
    yield c
    c.close()


# ---------------------------------------------------------------- a raw HTTP/2 client


class RawClient:
    """Frames by hand: what the test sends is exactly what the server receives."""

    def __init__(self, target: str, settings: dict[int, int] | None = None) -> None:
        host, port = target.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buffer = b""
        # Frames read past while waiting for a PING's answer, handed out first.
        self.held: list[tuple[int, int, int, bytes]] = []
        self.server_settings: dict[int, int] = {}
        payload = b"".join(struct.pack(">HL", k, v) for k, v in (settings or {}).items())
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, payload))

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def round_trip(self) -> None:
        """Send a PING and read until its ACK: the server has read everything sent before."""
        self.send(frame(PING, 0, 0, PROBE))
        while True:
            found = self._next_frame(5.0)
            if found[0] == PING and found[1] & ACK and found[3] == PROBE:
                return
            self.held.append(found)

    def read_frame(self, timeout: float = 5.0) -> tuple[int, int, int, bytes]:
        return self.held.pop(0) if self.held else self._next_frame(timeout)

    def _next_frame(self, timeout: float) -> tuple[int, int, int, bytes]:
        self.sock.settimeout(timeout)
        while True:
            if len(self.buffer) >= 9:
                hi, lo, kind, flags, stream_id = FRAME.unpack_from(self.buffer)
                length = (hi << 8) | lo
                if len(self.buffer) >= 9 + length:
                    payload = self.buffer[9 : 9 + length]
                    self.buffer = self.buffer[9 + length :]
                    if kind == SETTINGS and not flags & ACK:
                        for at in range(0, length, 6):
                            key, value = struct.unpack_from(">HL", payload, at)
                            self.server_settings[key] = value
                        self.send(frame(SETTINGS, ACK, 0))
                    return kind, flags, stream_id & 0x7FFFFFFF, payload
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buffer += chunk

    def headers(self, path: str, *extra: tuple[str, str]) -> bytes:
        fields = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "mock"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ]
        return self.encoder.encode(fields)

    def decode(self, block: bytes) -> dict[str, str]:
        return {str(k): str(v) for k, v in self.decoder.decode(block)}


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(len(payload) >> 8, len(payload) & 0xFF, kind, flags, stream_id) + payload


def frame_kinds(data: bytes) -> list[int]:
    kinds = []
    while len(data) >= 9:
        hi, lo, kind, _, _ = FRAME.unpack_from(data)
        kinds.append(kind)
        data = data[9 + ((hi << 8) | lo) :]
    return kinds


def message(payload: bytes) -> bytes:
    return struct.pack(">BL", 0, len(payload)) + payload


def split_messages(data: bytes) -> list[bytes]:
    out = []
    while data:
        length = struct.unpack_from(">L", data, 1)[0]
        out.append(data[5 : 5 + length])
        data = data[5 + length :]
    return out


def data_until_quiet(raw: RawClient, quiet_s: float) -> bytes:
    """DATA payloads (each within the default frame size) until the server goes quiet."""
    received = b""
    while True:
        try:
            kind, _, _, payload = raw.read_frame(timeout=quiet_s)
        except TimeoutError:
            return received
        if kind == DATA:
            assert len(payload) <= 16_384
            received += payload


def generate_request(tokens: int, request_id: str | None = None, **fields: Any) -> bytes:
    req = request(prompt(11, 24), max_new_tokens=tokens, request_id=request_id, **fields)
    return bytes(req.SerializeToString())


# ---------------------------------------------------------------- parity with grpc.aio


def _status(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def _statuses(target: str) -> list[tuple[grpc.StatusCode, str]]:
    c = Client(target)
    health: Any = health_pb2_grpc.HealthStub(c.channel)
    unknown = c.channel.unary_unary("/vllm.Inference/Nope")
    bad_rank = (("x-data-parallel-rank", "zero"),)
    try:
        return [
            _status(lambda: unknown(b"", timeout=5)),
            _status(lambda: c.control.Shutdown(control_pb2.ShutdownRequest(), timeout=5)),
            _status(lambda: c.control.ListLoras(control_pb2.ListLorasRequest(), timeout=5)),
            _status(lambda: health.Check(health_pb2.HealthCheckRequest(service="x"), timeout=5)),
            _status(lambda: health.List(health_pb2.HealthListRequest(), timeout=5)),
            _status(lambda: c.stream(request(prompt(1, 8)), rank=7)),
            _status(lambda: c.inference.Generate(request(prompt(1, 8)), metadata=bad_rank)),
            _status(lambda: c.inference.Generate(request([], model="other"), timeout=5)),
        ]
    finally:
        c.close()


def test_statuses_match_grpc_aio(inloop: MockEngineHandle, grpcio: MockEngineHandle) -> None:
    ours, theirs = _statuses(inloop.target), _statuses(grpcio.target)
    assert ours == theirs
    assert ours[0] == (grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    assert ours[1] == (grpc.StatusCode.UNIMPLEMENTED, "Shutdown is not implemented")
    assert ours[3] == (grpc.StatusCode.NOT_FOUND, "")
    assert ours[4][0] is grpc.StatusCode.UNIMPLEMENTED
    assert ours[5][0] is grpc.StatusCode.INVALID_ARGUMENT
    assert ours[6][0] is grpc.StatusCode.INVALID_ARGUMENT


def test_same_stream_on_both_servers(inloop: MockEngineHandle, grpcio: MockEngineHandle) -> None:
    streams = []
    for handle in (inloop, grpcio):
        c = Client(handle.target)
        try:
            streams.append(c.stream(request(prompt(4, 30), max_new_tokens=6), rank=1))
        finally:
            c.close()
    # How tokens are grouped into messages depends on the reader's pace; the content does not.
    assert streams[0][0] == streams[1][0]
    outputs = [[t for m in stream[1:] for t in m.outputs.token_ids] for stream in streams]
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == 6
    assert streams[0][-1].outputs.finish_info == streams[1][-1].outputs.finish_info


# ---------------------------------------------------------------- grpcio clients


def test_large_request_spans_many_frames(client: Client) -> None:
    ids = prompt(5, 30_000)
    reply = client.inference.Generate(request(ids, max_new_tokens=2), timeout=30)
    assert reply.prompt_info.num_prompt_tokens == 30_000
    assert len(reply.outputs.token_ids) == 2


def test_large_response_is_framed_within_the_peer_limits(client: Client) -> None:
    ids = prompt(6, 20_000)
    shape = inference_pb2.ResponseOptions(prompt_token_ids=True, prompt_logprobs=True)
    messages = client.stream(request(ids, max_new_tokens=2, response=shape))
    assert list(messages[0].prompt_info.token_ids) == ids
    assert len(messages[0].prompt_info.logprobs) == 20_000


def test_finished_calls_leave_nothing_for_the_cyclic_collector(client: Client) -> None:
    """The engine's own CPU is part of every benchmark run against it."""
    ids = prompt(7, 64)
    client.inference.Generate(request(ids), timeout=30)
    with cyclic_garbage("rankgate.mocker") as left:
        for _ in range(3):
            assert len(client.inference.Generate(request(ids), timeout=30).outputs.token_ids) == 4
            assert len(client.stream(request(ids))) >= 2
    assert not left


def test_gzip_request_is_accepted(inloop: MockEngineHandle) -> None:
    channel = grpc.insecure_channel(inloop.target, compression=grpc.Compression.Gzip)
    try:
        call = channel.unary_unary(
            "/vllm.Inference/Generate",
            request_serializer=inference_pb2.GenerateRequest.SerializeToString,
            response_deserializer=inference_pb2.GenerateResponse.FromString,
        )
        reply = call(request(prompt(7, 400), max_new_tokens=3), timeout=10)
        assert reply.prompt_info.num_prompt_tokens == 400
    finally:
        channel.close()


def test_cancelled_stream_frees_its_engine_request(client: Client) -> None:
    with engine(kv_events_port=None, kv_replay_port=None, speed=1.0) as handle:
        c = Client(handle.target)
        try:
            calls = [
                c.inference.GenerateStream(request(prompt(8, 16), max_new_tokens=2000), timeout=30)
                for _ in range(4)
            ]
            for call in calls:
                next(call)
                next(call)
            before = handle.stats(0).aborts + handle.stats(1).aborts
            for call in calls:
                call.cancel()
            handle.wait_idle()
            stats = handle.all_stats().values()
            assert sum(s.aborts for s in stats) == before + 4
            assert all(s.leaked == 0 and s.active == 0 for s in stats)
        finally:
            c.close()


def test_client_deadline_frees_the_engine_request() -> None:
    with engine(kv_events_port=None, kv_replay_port=None, speed=1.0) as handle:
        c = Client(handle.target)
        try:
            call = c.inference.GenerateStream(
                request(prompt(9, 16), max_new_tokens=2000), timeout=0.3
            )
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
            assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            handle.wait_idle()
            assert all(s.leaked == 0 for s in handle.all_stats().values())
        finally:
            c.close()


def test_health_watch_streams_changes(inloop: MockEngineHandle) -> None:
    c = Client(inloop.target)
    health: Any = health_pb2_grpc.HealthStub(c.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service="vllm.Inference"), timeout=10)
    try:
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        inloop.faults.set_serving(False)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        inloop.faults.set_serving(True)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        watch.cancel()
        inloop.faults.set_serving(True)
        c.close()


def test_stop_lets_a_running_stream_finish_and_refuses_new_calls() -> None:
    with engine(kv_events_port=None, kv_replay_port=None, speed=1.0) as handle:
        c = Client(handle.target)
        try:
            call = c.inference.GenerateStream(
                request(prompt(10, 16), max_new_tokens=40), timeout=30
            )
            next(call)
            stopper = threading.Thread(target=lambda: handle.run(handle.server.stop(grace=10)))
            stopper.start()
            rest = list(call)
            stopper.join(15)
            assert rest[-1].outputs.finish_info.finish_reason == inference_pb2.FinishInfo.LENGTH
            assert sum(len(m.outputs.token_ids) for m in rest) == 40
            with pytest.raises(grpc.RpcError) as caught:
                c.stream(request(prompt(10, 16)))
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            c.close()


# ---------------------------------------------------------------- a raw client


def test_tiny_window_is_never_exceeded(inloop: MockEngineHandle) -> None:
    window = 16
    raw = RawClient(inloop.target, {0x4: window})
    try:
        body = message(
            generate_request(
                12, response=inference_pb2.ResponseOptions(output_text=True, output_token_ids=True)
            )
        )
        raw.send(frame(HEADERS, END_HEADERS, 1, raw.headers("/vllm.Inference/GenerateStream")))
        raw.send(frame(DATA, END_STREAM, 1, body))
        received = b""
        granted = window
        trailers: dict[str, str] = {}
        while not trailers:
            kind, flags, stream_id, payload = raw.read_frame()
            if kind == DATA:
                assert stream_id == 1
                assert len(received) + len(payload) <= granted
                received += payload
                granted += len(payload)
                raw.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", len(payload))))
            elif kind == HEADERS and flags & END_STREAM:
                trailers = raw.decode(payload)
            elif kind == HEADERS:
                assert raw.decode(payload)[":status"] == "200"
        assert trailers["grpc-status"] == "0"
        messages = [inference_pb2.GenerateResponse.FromString(m) for m in split_messages(received)]
        assert messages[0].prompt_info.num_prompt_tokens == 24
        assert sum(len(m.outputs.token_ids) for m in messages) == 12
        assert raw.server_settings[0x3] > 0  # max concurrent streams advertised
    finally:
        raw.close()


def test_request_cut_into_pieces_and_ping(inloop: MockEngineHandle) -> None:
    raw = RawClient(inloop.target)
    try:
        body = message(generate_request(3))
        block = raw.headers("/vllm.Inference/Generate")
        raw.send(frame(HEADERS, 0, 1, block[:5]) + frame(0x9, END_HEADERS, 1, block[5:]))
        for at in range(0, len(body), 3):
            raw.send(frame(DATA, 0, 1, body[at : at + 3]))
            raw.round_trip()  # so that each piece is a read of its own
        raw.send(frame(PING, 0, 0, b"12345678"))
        raw.send(frame(DATA, END_STREAM, 1))
        got_ping = False
        received = b""
        trailers: dict[str, str] = {}
        # The reply may finish before the PING arrives: read until both are in.
        while not (trailers and got_ping):
            kind, flags, _, payload = raw.read_frame()
            if kind == PING:
                assert flags & ACK
                assert payload == b"12345678"
                got_ping = True
            elif kind == DATA:
                received += payload
            elif kind == HEADERS and flags & END_STREAM:
                trailers = raw.decode(payload)
        assert got_ping
        assert trailers["grpc-status"] == "0"
        (reply,) = split_messages(received)
        assert len(inference_pb2.GenerateResponse.FromString(reply).outputs.token_ids) == 3
    finally:
        raw.close()


def test_reset_and_lost_connections_free_engine_requests() -> None:
    with engine(kv_events_port=None, kv_replay_port=None, speed=1.0) as handle:
        raw = RawClient(handle.target)
        for stream_id in (1, 3, 5, 7):
            body = message(generate_request(2000, request_id=f"raw-{stream_id}"))
            raw.send(
                frame(
                    HEADERS, END_HEADERS, stream_id, raw.headers("/vllm.Inference/GenerateStream")
                )
            )
            raw.send(frame(DATA, END_STREAM, stream_id, body))
        seen: set[int] = set()
        while len(seen) < 4:
            kind, _, stream_id, _ = raw.read_frame()
            if kind == DATA:
                seen.add(stream_id)
        raw.send(frame(RST_STREAM, 0, 1, struct.pack(">L", 0x8)))
        wait_until(
            lambda: sum(handle.active().values()) == 3, 5, lambda: f"active: {handle.active()}"
        )
        raw.close()
        handle.wait_idle()
        stats = handle.all_stats().values()
        assert sum(s.aborts for s in stats) == 4
        assert all(s.leaked == 0 for s in stats)


def test_server_deadline_ends_the_call(inloop: MockEngineHandle) -> None:
    with engine(kv_events_port=None, kv_replay_port=None, speed=1.0) as handle:
        raw = RawClient(handle.target)
        try:
            block = raw.headers("/vllm.Inference/GenerateStream", ("grpc-timeout", "200m"))
            raw.send(frame(HEADERS, END_HEADERS, 1, block))
            raw.send(frame(DATA, END_STREAM, 1, message(generate_request(2000))))
            trailers: dict[str, str] = {}
            while not trailers:
                kind, flags, _, payload = raw.read_frame()
                if kind == HEADERS:
                    decoded = raw.decode(payload)
                    if flags & END_STREAM:
                        trailers = decoded
            assert trailers["grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
            assert trailers["grpc-message"] == "Deadline Exceeded"
            handle.wait_idle()
            assert all(s.leaked == 0 for s in handle.all_stats().values())
        finally:
            raw.close()


def test_unknown_method_is_trailers_only(inloop: MockEngineHandle) -> None:
    raw = RawClient(inloop.target)
    try:
        raw.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, raw.headers("/vllm.Nope/Nope")))
        while True:
            kind, flags, stream_id, payload = raw.read_frame()
            if kind == HEADERS:
                break
        assert stream_id == 1
        assert flags & END_STREAM
        fields = raw.decode(payload)
        assert fields[":status"] == "200"
        assert fields["grpc-status"] == "12"
        assert fields["grpc-message"] == "Method not found!"
    finally:
        raw.close()


def test_bad_preface_gets_goaway(inloop: MockEngineHandle) -> None:
    host, port = inloop.target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert frame_kinds(data)[-1] == GOAWAY
    # The server is unharmed.
    c = Client(inloop.target)
    try:
        assert len(c.stream(request(prompt(3, 8), max_new_tokens=2))) == 3
    finally:
        c.close()


def test_connection_window_and_frame_size_bound_a_large_reply(inloop: MockEngineHandle) -> None:
    raw = RawClient(inloop.target, {0x4: 1 << 20})
    try:
        shape = inference_pb2.ResponseOptions(prompt_token_ids=True, prompt_logprobs=True)
        req = request(prompt(12, 20_000), max_new_tokens=1, response=shape)
        raw.send(frame(HEADERS, END_HEADERS, 1, raw.headers("/vllm.Inference/Generate")))
        body = message(req.SerializeToString())
        for at in range(0, len(body), 16_384):
            last = at + 16_384 >= len(body)
            raw.send(frame(DATA, END_STREAM if last else 0, 1, body[at : at + 16_384]))
        # The reply fills the connection's initial window (however long the engine takes to
        # start it), and nothing more comes until the client opens the window.
        received = b""
        while len(received) < 65_535:
            kind, _, _, payload = raw.read_frame(timeout=30)
            if kind == DATA:
                assert len(payload) <= 16_384
                received += payload
        assert len(received) == 65_535
        assert data_until_quiet(raw, 0.5) == b""
        raw.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 1 << 24)))
        trailers: dict[str, str] = {}
        while not trailers:
            kind, flags, _, payload = raw.read_frame()
            if kind == DATA:
                assert len(payload) <= 16_384
                received += payload
            elif kind == HEADERS and flags & END_STREAM:
                trailers = raw.decode(payload)
        assert trailers["grpc-status"] == "0"
        (reply,) = split_messages(received)
        info = inference_pb2.GenerateResponse.FromString(reply).prompt_info
        assert len(info.token_ids) == 20_000
    finally:
        raw.close()


async def _read_frames(
    reader: asyncio.StreamReader, until: Callable[[int, int, int, bytes], bool]
) -> None:
    while True:
        head = await asyncio.wait_for(reader.readexactly(9), 5)
        hi, lo, kind, flags, stream_id = FRAME.unpack(head)
        payload = await reader.readexactly((hi << 8) | lo)
        if until(kind, flags, stream_id & 0x7FFFFFFF, payload):
            return


async def test_streams_over_the_advertised_limit_are_refused() -> None:
    server = H2Server(max_message=1 << 20, max_concurrent_streams=2)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    encoder = hpack.Encoder()
    watch = message(health_pb2.HealthCheckRequest(service="").SerializeToString())
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/grpc.health.v1.Health/Watch"),
        (":authority", "mock"),
        ("content-type", "application/grpc"),
    ]
    out = PREFACE + frame(SETTINGS, 0, 0)
    for stream_id in (1, 3, 5):
        out += frame(HEADERS, END_HEADERS, stream_id, encoder.encode(fields))
        out += frame(DATA, END_STREAM, stream_id, watch)
    writer.write(out)
    settings: dict[int, int] = {}
    answered: set[int] = set()
    refused: list[tuple[int, int]] = []

    def seen(kind: int, flags: int, stream_id: int, payload: bytes) -> bool:
        if kind == SETTINGS and not flags & ACK:
            settings.update(
                struct.unpack_from(">HL", payload, at) for at in range(0, len(payload), 6)
            )
        elif kind == DATA:
            answered.add(stream_id)
        elif kind == RST_STREAM:
            refused.append((stream_id, struct.unpack(">L", payload)[0]))
        return len(answered) == 2 and bool(refused)

    try:
        await _read_frames(reader, seen)
        assert settings[0x3] == 2
        assert answered == {1, 3}
        assert refused == [(5, 0x7)]  # REFUSED_STREAM: the client may retry it elsewhere
        # Stopping without grace ends the open watches and closes the connection.
        await asyncio.wait_for(server.stop(None), 5)
        await asyncio.wait_for(server.wait_for_termination(), 1)
        rest = await asyncio.wait_for(reader.read(), 5)
        assert reader.at_eof()
        assert GOAWAY in frame_kinds(rest)
    finally:
        writer.close()
        await server.stop(None)
