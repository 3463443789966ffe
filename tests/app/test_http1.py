"""The gateway's HTTP/1.1 server: its limits through raw sockets (oversized heads, slow and
silent clients, the cap), and its framing against uvicorn's.

The socket tests talk to a gateway served the way ``rankgate serve`` serves (``uvicorn_config``)
with small limits, so that a limit is reached in well under a second.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import weakref
from collections.abc import Iterator
from typing import Any, cast

import httpx
import orjson
import pytest
from uvicorn.protocols.http.flow_control import FlowControl as UvicornFlow
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, RequestResponseCycle

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.app.serving.connections import ConnectionLimits
from rankgate.app.serving.http1_exchange import (
    Exchange,
    FlowControl,
    bad_header_name,
    bad_header_value,
)
from rankgate.app.serving.http1_writers import ChunkWriter, WholeAnswer
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import SkewedLoop, serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.loop_probe import health_probe
from tests.support.polling import wait_until

LIMITS = ConnectionLimits(
    max_header_bytes=8192,
    max_headers=32,
    header_timeout=1.0,
    body_timeout=1.0,
    keepalive_timeout=1,
    max_connections=8,
)
JSON = {"content-type": "application/json"}
BODY = orjson.dumps(
    {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
)


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)


@pytest.fixture(scope="module")
def gateway(engine: ScriptedEngine) -> Iterator[str]:
    app = create_app(GatewaySettings(connections=LIMITS), engine=engine)
    with serve_app(app, connections=LIMITS) as url:
        yield url


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def head(*extra: bytes, length: int = len(BODY)) -> bytes:
    lines = [
        b"POST /v1/chat/completions HTTP/1.1",
        b"host: gateway",
        b"content-type: application/json",
        b"content-length: %d" % length,
        *extra,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, bytes, bool]:
    """Status, body and whether the server then closed the connection."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    status = int(header.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in header.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    try:
        closed = sock.recv(1) == b""
    except TimeoutError:
        closed = False
    return status, rest[:length], closed


def still_serving(gateway: str) -> bool:
    response = httpx.post(f"{gateway}/v1/chat/completions", content=BODY, headers=JSON)
    return response.status_code == 200


def error_code(body: bytes) -> str:
    code: str = orjson.loads(body)["error"]["code"]
    return code


def test_a_huge_header_is_431_after_the_limit_not_after_the_upload(gateway: str) -> None:
    with socket.create_connection(address(gateway)) as sock, health_probe(gateway) as probe:
        sock.sendall(head()[:-2] + b"x-filler: ")
        sent = 0
        try:
            for _ in range(200):  # 200 MiB if the server kept reading
                sock.sendall(b"a" * (1 << 20))
                sent += 1
        except OSError:
            pass
        status, body, closed = read_response(sock)
    assert status == 431
    assert error_code(body) == "headers_too_large"
    assert closed
    assert sent < 200
    assert probe.max_latency < 1.0
    assert (
        httpx.post(f"{gateway}/v1/chat/completions", content=BODY, headers=JSON).status_code == 200
    )


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ([b"x-h%d: v" % i for i in range(LIMITS.max_headers)], 431),
        ([b"x-h%d: v" % i for i in range(LIMITS.max_headers - 8)], 200),
        ([b"x-big: " + b"b" * (LIMITS.max_header_bytes - 400)], 200),
        ([b"x-big: " + b"b" * LIMITS.max_header_bytes], 431),
    ],
    ids=["too-many", "many", "large", "too-large"],
)
def test_header_count_and_size_limits(gateway: str, extra: list[bytes], status: int) -> None:
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(head(*extra) + BODY)
        got, body, _ = read_response(sock)
    assert got == status, body
    if status == 431:
        assert error_code(body) == "headers_too_large"


def test_a_body_sent_with_its_head_may_pass_the_header_limit(gateway: str) -> None:
    big = orjson.dumps(
        {
            "model": SCRIPTED_MODEL,
            "messages": [{"role": "user", "content": "x " * LIMITS.max_header_bytes}],
            "max_tokens": 2,
        }
    )
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(head(length=len(big)) + big)
        status, body, _ = read_response(sock)
    assert status in (200, 400), body  # 400: longer than the scripted context
    assert error_code(body) != "headers_too_large" if status != 200 else True


def test_slowloris_gets_408_at_the_header_deadline(gateway: str) -> None:
    started = time.monotonic()
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        sock.settimeout(0.2)
        answer = b""
        for i in range(40):
            try:
                sock.sendall(b"x-slow-%d: v\r\n" % i)
                answer = sock.recv(4096)
                break
            except TimeoutError:
                continue
            except OSError:
                break
    elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert LIMITS.header_timeout <= elapsed < LIMITS.header_timeout + 3


def test_a_silent_connection_is_closed_at_the_header_deadline(gateway: str) -> None:
    started = time.monotonic()
    with socket.create_connection(address(gateway)) as sock:
        sock.settimeout(10)
        assert sock.recv(4096) == b""
    assert LIMITS.header_timeout <= time.monotonic() - started < LIMITS.header_timeout + 3


def test_a_slow_body_gets_408_and_the_request_ends_as_a_client_disconnect(
    gateway: str, engine: ScriptedEngine
) -> None:
    before = len(engine.requests)
    started = time.monotonic()
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(head())
        sock.settimeout(0.2)
        answer = b""
        for byte in BODY[:-1]:
            try:
                sock.sendall(bytes([byte]))
                answer = sock.recv(4096)
                break
            except TimeoutError:
                continue
            except OSError:
                break
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started < LIMITS.body_timeout + 3
    assert len(engine.requests) == before
    metrics = httpx.get(f"{gateway}/metrics").text
    assert 'status="499"' in metrics


def test_an_idle_keepalive_connection_is_closed(gateway: str) -> None:
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(head() + BODY)
        status, _, closed = read_response(sock, timeout=0.5)
        assert status == 200
        assert not closed
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1) == b""
    assert time.monotonic() - started < LIMITS.keepalive_timeout + 3


def test_a_connection_answered_before_its_body_ended_is_closed_when_idle(gateway: str) -> None:
    """A request refused at its head (415 here) whose body then arrives leaves an idle
    keep-alive connection, which is closed at the keep-alive deadline like any other."""
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(head(length=len(BODY)).replace(b"application/json", b"text/plain"))
        status, _, closed = read_response(sock, timeout=0.3)
        assert (status, closed) == (415, False)
        sock.sendall(BODY)
        started = time.monotonic()
        sock.settimeout(LIMITS.keepalive_timeout + 5)
        assert sock.recv(1) == b""
    assert time.monotonic() - started < LIMITS.keepalive_timeout + 3


def test_a_request_answered_before_its_body_gets_no_second_answer(gateway: str) -> None:
    """A request refused at its head whose body never comes is not answered again (408) at
    the body deadline: its connection is closed."""
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(head(length=len(BODY)).replace(b"application/json", b"text/plain"))
        status, _, _ = read_response(sock, timeout=0.3)
        assert status == 415
        sock.settimeout(LIMITS.body_timeout + 5)
        assert sock.recv(65536) == b""


def test_requests_on_one_keepalive_connection_still_work(gateway: str) -> None:
    with socket.create_connection(address(gateway)) as sock:
        for _ in range(3):
            sock.sendall(head() + BODY)
            status, body, _ = read_response(sock, timeout=0.5)
            assert status == 200, body


def test_a_response_does_not_name_the_server(gateway: str) -> None:
    response = httpx.post(f"{gateway}/v1/chat/completions", content=BODY, headers=JSON)
    assert response.status_code == 200
    assert "server" not in response.headers


def test_a_stream_outlives_the_header_deadline(gateway: str, engine: ScriptedEngine) -> None:
    engine.delay = 0.15
    try:
        body = orjson.loads(BODY)
        body.update(stream=True, max_tokens=16)
        engine.outputs = ["one two three four five six seven eight nine ten eleven twelve"]
        started = time.monotonic()
        with httpx.stream(
            "POST", f"{gateway}/v1/chat/completions", json=body, timeout=30
        ) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data:")]
        assert time.monotonic() - started > LIMITS.header_timeout
        assert lines[-1] == "data: [DONE]"
    finally:
        engine.delay = 0.0
        engine.outputs = ["Hello there."]


def _get(gateway: str, path: str) -> tuple[int, bytes, bool]:
    sock = socket.create_connection(address(gateway))
    try:
        sock.sendall(b"GET %s HTTP/1.1\r\nhost: gateway\r\n\r\n" % path.encode())
        return read_response(sock)
    finally:
        sock.close()


def test_a_flood_of_idle_and_slow_sockets_locks_nobody_out(engine: ScriptedEngine) -> None:
    """Each connection past the cap takes the place of the one that has waited longest
    without a request: probes and requests get through, the flood's oldest sockets go."""
    loops: list[SkewedLoop] = []

    def skewed() -> SkewedLoop:
        loops.append(SkewedLoop())
        return loops[-1]

    app = create_app(GatewaySettings(connections=LIMITS), engine=engine)
    flood: list[socket.socket] = []
    with serve_app(app, connections=LIMITS, loop_factory=skewed) as gateway:
        try:
            for i in range(3 * LIMITS.max_connections):
                sock = socket.create_connection(address(gateway))
                if i % 2:
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: ")  # trickling
                flood.append(sock)
            # Past the cap and its reserve, the newest are refused: the gateway has taken in the
            # whole flood once it answers the last.
            flood[-1].settimeout(10)
            assert flood[-1].recv(15) == b"HTTP/1.1 503 Se"
            # Sockets younger than the grace are spared (their request may be in flight): the
            # gateway's clock moves on by the grace, well short of the flood's head deadlines.
            loops[-1].skew += LIMITS.eviction_grace
            for path in ("/health", "/ready"):
                status, _, _ = _get(gateway, path)
                assert status == 200
            assert still_serving(gateway)
            oldest = flood[0]
            oldest.settimeout(5)
            assert oldest.recv(4096) == b"", "the longest-waiting socket was closed for newcomers"
        finally:
            for sock in flood:
                sock.close()


def test_probes_answer_when_every_connection_is_busy(gateway: str, engine: ScriptedEngine) -> None:
    """With a request in flight on every connection, the probes still get through (a few
    places past the cap), and anything else there is 503 ``too_many_connections``."""
    engine.delay = 0.2
    engine.outputs = ["one two three four five six seven eight nine ten"]
    body = orjson.loads(BODY)
    body.update(stream=True, max_tokens=10)
    busy: list[socket.socket] = []
    closed = engine.closed
    try:
        payload = orjson.dumps(body)
        # Every place is taken by a stream that runs for a couple of seconds, each seen
        # streaming before the next connects.
        for _ in range(LIMITS.max_connections):
            sock = socket.create_connection(address(gateway))
            sock.sendall(head(length=len(payload)) + payload)
            busy.append(sock)
            sock.settimeout(10)
            assert sock.recv(15).startswith(b"HTTP/1.1 200")
        for path in ("/health", "/ready"):
            status, _, closed = _get(gateway, path)
            assert status == 200
            assert closed, "a probe's place past the cap is for one answer"
        sock = socket.create_connection(address(gateway))
        busy.append(sock)
        sock.sendall(head() + BODY)
        status, answer, closed = read_response(sock)
        assert (status, error_code(answer), closed) == (503, "too_many_connections", True)
    finally:
        for sock in busy:
            sock.close()
        engine.delay = 0.0
        engine.outputs = ["Hello there."]
    # Every stream has ended, so its connection is gone from the count.
    wait_until(
        lambda: engine.closed >= closed + LIMITS.max_connections,
        10,
        lambda: f"{engine.closed - closed} of {LIMITS.max_connections} streams ended",
    )
    assert still_serving(gateway)


def test_bytes_that_are_not_http_get_a_json_400(gateway: str) -> None:
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nx-bad: \x01\x02\r\n\r\n")
        status, body, closed = read_response(sock)
    assert status == 400
    assert error_code(body) == "invalid_http"
    assert closed


def _dechunk(data: bytes) -> tuple[list[bytes], bool]:
    """The chunks of a chunked body, and whether its terminating chunk was there."""
    chunks: list[bytes] = []
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return chunks, data == b"\r\n"
        chunks.append(data[:size])
        assert data[size : size + 2] == b"\r\n", data[: size + 2]
        data = data[size + 2 :]
    return chunks, False


def test_streamed_chunks_are_written_directly_and_framed_as_uvicorn_frames_them(
    gateway: str, engine: ScriptedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every SSE chunk after the first goes straight to the socket, each one an HTTP chunk
    of its own, and the body ends with the terminating chunk: what ``send`` would write."""
    direct: list[bytes] = []
    write = ChunkWriter.write

    def counted(self: ChunkWriter, body: bytes) -> bool:
        wrote = write(self, body)
        if wrote:
            direct.append(body)
        return wrote

    monkeypatch.setattr(ChunkWriter, "write", counted)
    engine.outputs = ["one two three four five six"]
    try:
        body = orjson.loads(BODY)
        body.update(stream=True, max_tokens=6)
        payload = orjson.dumps(body)
        sock = socket.create_connection(address(gateway))
        sock.settimeout(10)
        try:
            sock.sendall(head(length=len(payload)) + payload)
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                chunk = sock.recv(65536)
                assert chunk, data
                data += chunk
        finally:
            sock.close()
    finally:
        engine.outputs = ["Hello there."]
    header, _, rest = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in header.lower()
    chunks, ended = _dechunk(rest)
    assert ended
    events = [event for chunk in chunks for event in chunk.split(b"\n\n") if event]
    assert events[-1] == b"data: [DONE]"
    text = "".join(
        choice["delta"].get("content", "")
        for event in events[:-1]
        for choice in orjson.loads(event.removeprefix(b"data: "))["choices"]
    )
    assert text == "one two three four five six"
    # The first chunk and the tail go through send; every chunk between them went direct.
    assert direct == chunks[1:-1]
    assert len(direct) >= 4


class _Flow:
    write_paused = False


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


class _Exchange:
    def __init__(self) -> None:
        self.chunked_encoding: bool | None = True
        self.response_complete = False
        self.disconnected = False
        self.flow = _Flow()
        self.transport = _Transport()

    def write(self, data: bytes) -> None:
        self.transport.write(data)


@pytest.mark.parametrize(
    ("state", "value"),
    [
        ("chunked_encoding", None),
        ("chunked_encoding", False),
        ("response_complete", True),
        ("disconnected", True),
        ("write_paused", True),
    ],
)
def test_the_chunk_writer_leaves_to_send_what_send_must_handle(state: str, value: object) -> None:
    """A response not chunked (not started, or with a length), complete, whose client left,
    or whose socket is full: the writer declines, so ``send`` waits, drops or refuses as it
    does."""
    exchange = _Exchange()
    writer = ChunkWriter(exchange)
    assert writer.write(b"data: 1\n\n")
    assert exchange.transport.written == [b"9\r\ndata: 1\n\n\r\n"]
    setattr(exchange.flow if state == "write_paused" else exchange, state, value)
    assert not writer.write(b"data: 2\n\n")
    assert exchange.transport.written == [b"9\r\ndata: 1\n\n\r\n"]


def test_pipelined_answers_arrive_whole_and_in_order(gateway: str, engine: ScriptedEngine) -> None:
    """Each answer's head is held for its body: answers to requests sent back to
    back on one connection still arrive each whole, in the order asked."""
    engine.outputs = ["first answer", "second answer"]
    bodies = [orjson.dumps({**orjson.loads(BODY), "n": n}) for n in (1, 2)]
    answers: list[tuple[int, bytes]] = []
    try:
        with socket.create_connection(address(gateway)) as sock:
            sock.settimeout(10)
            sock.sendall(b"".join(head(length=len(body)) + body for body in bodies))
            data = b""
            while len(answers) < 2:
                header, gap, rest = data.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in header.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    None,
                )
                if gap and length is not None and len(rest) >= length:
                    answers.append((int(header.split(b" ", 2)[1]), rest[:length]))
                    data = rest[length:]
                    continue
                chunk = sock.recv(65536)
                assert chunk, data
                data += chunk
    finally:
        engine.outputs = ["Hello there."]
    assert [status for status, _ in answers] == [200, 200]
    contents = [
        [choice["message"]["content"] for choice in orjson.loads(body)["choices"]]
        for _, body in answers
    ]
    assert contents == [["first answer"], ["first answer", "second answer"]]


class _ClosingTransport(_Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


def _exchange(
    loop: asyncio.AbstractEventLoop, *, keep_alive: bool = True, method: str = "POST"
) -> tuple[Exchange, _ClosingTransport, list[str]]:
    """An exchange on a recording transport, as the protocol builds one."""
    raw = _ClosingTransport()
    responded: list[str] = []
    exchange = Exchange(
        {"type": "http", "method": method, "path": "/v1/chat/completions"},
        cast(Any, raw),
        FlowControl(cast(Any, raw)),
        loop,
        [(b"date", b"Sun, 06 Dec 2026 07:00:00 GMT")],
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: responded.append("done"),
    )
    return exchange, raw, responded


def _uvicorn_cycle(
    loop: asyncio.AbstractEventLoop, *, keep_alive: bool, method: str
) -> tuple[RequestResponseCycle, _ClosingTransport]:
    """uvicorn's own response cycle on a recording transport: the reference framing."""
    raw = _ClosingTransport()
    logger = logging.getLogger("test.cycle")
    cycle = RequestResponseCycle(
        scope=cast(Any, {"type": "http", "method": method, "path": "/", "http_version": "1.1"}),
        transport=cast(Any, raw),
        flow=UvicornFlow(cast(Any, raw)),
        logger=logger,
        access_logger=logger,
        access_log=False,
        default_headers=[(b"date", b"Sun, 06 Dec 2026 07:00:00 GMT")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )
    return cycle, raw


_ANSWER = b'{"id":"chatcmpl-1"}'
_HEADERS = [
    (b"content-length", b"%d" % len(_ANSWER)),
    (b"content-type", b"application/json"),
    (b"x-request-id", b"req-1"),
]
_RESPONSES: dict[str, tuple[str, int, list[tuple[bytes, bytes]], list[tuple[bytes, bool]]]] = {
    "json": ("POST", 200, _HEADERS, [(_ANSWER, False)]),
    "json in parts": ("POST", 200, _HEADERS, [(_ANSWER[:5], True), (_ANSWER[5:], False)]),
    "stream": (
        "POST",
        200,
        [(b"content-type", b"text/event-stream")],
        [(b"data: 1\n\n", True), (b"", True), (b"data: [DONE]\n\n", False)],
    ),
    "HEAD": ("HEAD", 200, _HEADERS, [(b"", False)]),
    "no content": ("POST", 204, [], [(b"", False)]),
    "close": ("POST", 400, [*_HEADERS, (b"Connection", b"close")], [(_ANSWER, False)]),
}


def test_a_response_header_is_refused_for_the_bytes_uvicorn_refuses() -> None:
    """Every byte value, alone and inside a name or value, is refused exactly when uvicorn's
    own expressions refuse it."""
    for byte in range(256):
        for text in (bytes([byte]), b"x-a" + bytes([byte]) + b"b"):
            assert bad_header_name(text) == bool(HEADER_RE.search(text)), text
            assert bad_header_value(text) == bool(HEADER_VALUE_RE.search(text)), text
    assert not bad_header_name(b"")
    assert not bad_header_value(b"")


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("case", sorted(_RESPONSES))
async def test_send_frames_a_response_as_uvicorn_frames_it(case: str, keep_alive: bool) -> None:
    """The bytes ``send`` writes for a response, and whether the connection is then closed,
    are uvicorn's own, byte for byte: the head (lowered names, ``connection: close``,
    chunked framing where no length is given) and the body's framing."""
    loop = asyncio.get_running_loop()
    method, status, headers, parts = _RESPONSES[case]
    exchange, raw, done = _exchange(loop, keep_alive=keep_alive, method=method)
    cycle, reference = _uvicorn_cycle(loop, keep_alive=keep_alive, method=method)
    for sender in (exchange.send, cycle.send):
        await sender({"type": "http.response.start", "status": status, "headers": headers})
        for body, more in parts:
            await sender({"type": "http.response.body", "body": body, "more_body": more})
    await asyncio.sleep(0)
    assert b"".join(raw.written) == b"".join(reference.written)
    assert raw.closing == reference.closing
    assert exchange.response_complete
    assert done == ["done"]


async def test_a_head_leaves_with_what_follows_it_in_its_tick_or_alone_at_the_tick_end() -> None:
    """What a response writes after its head in the same tick joins it in one write; a head
    with nothing after it goes out when the tick ends; closing writes it first; a transport
    that is closing gets nothing."""
    loop = asyncio.get_running_loop()
    start = {"type": "http.response.start", "status": 200, "headers": []}
    (whole, whole_raw, _), (stream, stream_raw, _) = _exchange(loop), _exchange(loop)
    (closed, closed_raw, _), (gone, gone_raw, _) = _exchange(loop), _exchange(loop)
    for exchange in (whole, stream, closed, gone):
        await exchange.send(start)

    await whole.send({"type": "http.response.body", "body": b"body", "more_body": True})
    assert len(whole_raw.written) == 1
    assert whole_raw.written[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert whole_raw.written[0].endswith(b"\r\n\r\n4\r\nbody\r\n")
    assert stream_raw.written == []
    closed.close()
    assert len(closed_raw.written) == 1
    assert closed_raw.closing
    gone_raw.closing = True
    await asyncio.sleep(0)
    assert len(stream_raw.written) == 1
    assert stream_raw.written[0].endswith(b"\r\n\r\n")
    assert gone_raw.written == []
    assert len(whole_raw.written) == 1


@pytest.mark.parametrize("keep_alive", [True, False])
async def test_a_whole_answer_is_the_bytes_send_writes_in_one_write(keep_alive: bool) -> None:
    """Written past ``send``, an answer is byte for byte what ``send`` writes for its two
    messages, in one write, and the exchange ends as ``send`` leaves it: complete, its
    ``receive`` told, the protocol told, a connection that is not kept alive closed."""
    loop = asyncio.get_running_loop()
    through_send, sent_raw, sent_done = _exchange(loop, keep_alive=keep_alive)
    await through_send.send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await through_send.send({"type": "http.response.body", "body": _ANSWER})

    direct, raw, done = _exchange(loop, keep_alive=keep_alive)
    whole = WholeAnswer.of({"rankgate.exchange": weakref.ref(direct)}, direct.send)
    assert whole is not None
    assert whole.write(200, _HEADERS, _ANSWER)
    assert raw.written == [b"".join(sent_raw.written)]
    assert raw.written[0].endswith(b"\r\n\r\n" + _ANSWER)
    assert (b"connection: close" in raw.written[0]) is not keep_alive
    for exchange in (through_send, direct):
        assert exchange.response_started
        assert exchange.response_complete
        assert await exchange.receive() == {"type": "http.disconnect"}
    assert done == sent_done == ["done"]
    assert raw.closing == sent_raw.closing == (not keep_alive)
    await asyncio.sleep(0)
    assert len(raw.written) == 1


@pytest.mark.parametrize(
    "case",
    [
        "wrapped send",
        "started",
        "disconnected",
        "write paused",
        "HEAD",
        "length differs",
        "no length",
        "transfer-encoding",
        "connection",
        "upper-case name",
        "newline in a value",
        "space in a name",
    ],
)
async def test_a_whole_answer_leaves_to_send_what_send_must_handle(case: str) -> None:
    """A ``send`` some middleware wraps, a response already started, a client gone, a full
    socket, a HEAD request, and any header ``send`` would refuse, lower or frame by: nothing
    is written, so the response goes through ``send`` as it always did."""
    loop = asyncio.get_running_loop()
    exchange, raw, done = _exchange(loop, method="HEAD" if case == "HEAD" else "POST")
    headers = list(_HEADERS)
    scope = {"rankgate.exchange": weakref.ref(exchange)}

    async def wrapped(message: Any) -> None:
        await exchange.send(message)

    if case == "wrapped send":
        assert WholeAnswer.of(scope, wrapped) is None
        return
    assert WholeAnswer.of({}, exchange.send) is None
    if case == "started":
        exchange.response_started = True
    elif case == "disconnected":
        exchange.disconnected = True
    elif case == "write paused":
        exchange.flow.write_paused = True
    elif case == "length differs":
        headers[0] = (b"content-length", b"%d" % (len(_ANSWER) + 1))
    elif case == "no length":
        del headers[0]
    elif case == "transfer-encoding":
        headers.append((b"transfer-encoding", b"chunked"))
    elif case == "connection":
        headers.append((b"connection", b"close"))
    elif case == "upper-case name":
        headers.append((b"X-Rank", b"1"))
    elif case == "newline in a value":
        headers.append((b"x-request-id", b"a\r\nset-cookie: b"))
    elif case == "space in a name":
        headers.append((b"x rank", b"1"))
    whole = WholeAnswer.of(scope, exchange.send)
    assert whole is not None
    assert not whole.write(200, headers, _ANSWER)
    await asyncio.sleep(0)
    assert raw.written == []
    assert not exchange.response_complete
    assert done == []


def test_an_expecting_client_refused_at_once_gets_the_interim_answer_first(gateway: str) -> None:
    """A client that sends ``Expect: 100-continue`` with an invalid body in one packet gets
    ``100 Continue`` (written as its body is read) and then the 400, whole, in that order."""
    body = b'{"model": '
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(head(b"expect: 100-continue", length=len(body)) + body)
        sock.settimeout(10)
        data = b""
        while b'"error"' not in data or not data.endswith(b"}}"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    interim, _, final = data.partition(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 Continue"
    assert final.startswith(b"HTTP/1.1 400 ")
    assert error_code(final.partition(b"\r\n\r\n")[2]) == "invalid_json"


async def _echo_scope(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app answering with what its server told it of the request."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    fields = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string")
    seen = {name: scope[name] for name in fields}
    seen["root_path"] = scope["root_path"]
    seen["headers"] = scope["headers"]
    seen["body"] = body
    answer = repr(seen).encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


_REQUESTS = {
    "plain path": b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n",
    "query and escapes": b"GET /a%20b/c?x=1&y=%2F HTTP/1.1\r\nHost: gw\r\nX-Trail: v \t\r\n\r\n",
    "fragment": b"GET /p#frag HTTP/1.1\r\nhost: gw\r\n\r\n",
    "absolute form": b"GET http://gw:80/abs/p?q=1 HTTP/1.1\r\nhost: gw\r\n\r\n",
    "HTTP/1.0": b"POST /v1/x HTTP/1.0\r\ncontent-length: 3\r\n\r\nabc",
    "chunked body": (
        b"POST /v1/x HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    ),
    "HEAD": b"HEAD /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n",
}


def _exchange_once(url: str, request: bytes) -> bytes:
    """Everything the server writes for ``request`` until it has answered and gone quiet."""
    with socket.create_connection(address(url)) as sock:
        sock.sendall(request)
        sock.settimeout(10)
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            data += chunk
            if not chunk:
                break
            if b"\r\n\r\n" in data:
                head, _, body = data.partition(b"\r\n\r\n")
                lengths = [
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ]
                if request.startswith(b"HEAD") or (lengths and len(body) >= lengths[0]):
                    sock.settimeout(0.2)
    return data


def test_a_request_reaches_the_app_as_uvicorn_presents_it() -> None:
    """What the app is told of a request (method, version, path unescaped, raw path, query,
    headers as sent but lowered and trimmed, the body however framed) and the answer written
    back are uvicorn's own, request for request."""
    answers: dict[str, list[bytes]] = {}
    for http in (None, "httptools"):
        with serve_app(_echo_scope, http=http) as url:
            for name, request in _REQUESTS.items():
                answer = _exchange_once(url, request)
                head, _, body = answer.partition(b"\r\n\r\n")
                lines = [line for line in head.split(b"\r\n") if not line.startswith(b"date:")]
                answers.setdefault(name, []).append(b"\r\n".join(lines) + b"\r\n\r\n" + body)
    for name, (ours, theirs) in answers.items():
        assert ours.startswith(b"HTTP/1.1 200 OK"), (name, ours)
        assert ours == theirs, name


def test_an_upgrade_is_answered_as_plain_http_and_the_connection_closed(gateway: str) -> None:
    """A request to switch protocols (h2c here, as ``curl --http2`` sends for http://) is
    answered as HTTP/1.1, which the client must then take, and the connection closes."""
    request = (
        b"GET /health HTTP/1.1\r\nhost: gw\r\nconnection: Upgrade, HTTP2-Settings\r\n"
        b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
    )
    with socket.create_connection(address(gateway)) as sock:
        sock.sendall(request)
        status, _, closed = read_response(sock)
    assert status == 200
    assert closed
    assert still_serving(gateway)


async def test_every_waiting_receive_hears_the_client_leave() -> None:
    """Two readers waiting on one request after its body (a disconnect listener beside the
    app, say) both hear the client leave."""
    exchange, _, _ = _exchange(asyncio.get_running_loop())
    exchange.body = b"{}"
    exchange.more_body = False
    exchange.notify()
    assert await exchange.receive() == {"type": "http.request", "body": b"{}", "more_body": False}
    readers = [asyncio.create_task(exchange.receive()) for _ in range(2)]
    await asyncio.sleep(0)
    assert not any(reader.done() for reader in readers)
    exchange.disconnected = True
    exchange.notify()
    assert await asyncio.wait_for(asyncio.gather(*readers), 5) == [{"type": "http.disconnect"}] * 2
