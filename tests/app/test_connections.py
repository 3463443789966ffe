"""HTTP connection limits through raw sockets: oversized heads, slow and silent clients, the cap.

Each test talks to a gateway served the way ``rankgate serve`` serves (``uvicorn_config``) with
small limits, so that a limit is reached in well under a second.
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
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from rankgate.app.connections import ChunkWriter, ConnectionLimits, HeldHead, WholeAnswer
from rankgate.app.server import create_app
from rankgate.app.settings import GatewaySettings
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.loop_probe import health_probe

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


def test_a_flood_of_idle_and_slow_sockets_locks_nobody_out(gateway: str) -> None:
    """Each connection past the cap takes the place of the one that has waited longest
    without a request: probes and requests get through, the flood's oldest sockets go."""
    flood: list[socket.socket] = []
    try:
        for i in range(3 * LIMITS.max_connections):
            sock = socket.create_connection(address(gateway))
            if i % 2:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: ")  # trickling
            flood.append(sock)
        # Sockets younger than the grace are spared (their request may be in flight).
        time.sleep(LIMITS.eviction_grace * 1.5)
        for path in ("/health", "/ready"):
            status, _, _ = _get(gateway, path)
            assert status == 200
        assert still_serving(gateway)
        oldest = flood[0]
        oldest.settimeout(5)
        assert oldest.recv(4096) == b"", "the longest-waiting socket was closed for the newcomers"
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
    time.sleep(0.3)
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


class _Cycle:
    def __init__(self) -> None:
        self.chunked_encoding: bool | None = True
        self.response_complete = False
        self.disconnected = False
        self.flow = _Flow()
        self.transport = _Transport()


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
    cycle = _Cycle()
    writer = ChunkWriter(cycle)
    assert writer.write(b"data: 1\n\n")
    assert cycle.transport.written == [b"9\r\ndata: 1\n\n\r\n"]
    setattr(cycle.flow if state == "write_paused" else cycle, state, value)
    assert not writer.write(b"data: 2\n\n")
    assert cycle.transport.written == [b"9\r\ndata: 1\n\n\r\n"]


def test_pipelined_answers_arrive_whole_and_in_order(gateway: str, engine: ScriptedEngine) -> None:
    """Each answer's head is held for its body (``HeldHead``): answers to requests sent back to
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


async def test_a_head_leaves_with_what_follows_it_in_its_tick_or_alone_at_the_tick_end() -> None:
    """What a cycle writes after its head in the same tick joins it in one write; a head with
    nothing after it goes out when the tick ends; close() writes it first; a transport that
    is closing gets nothing; and each cycle then writes to its transport directly."""
    loop = asyncio.get_running_loop()
    cycles: list[Any] = [_Cycle() for _ in range(4)]
    raws = [_ClosingTransport() for _ in cycles]
    for cycle, raw in zip(cycles, raws, strict=True):
        cycle.transport = HeldHead(cycle, cast(Any, raw), loop)
    (whole, stream, closed, gone), (whole_raw, stream_raw, closed_raw, gone_raw) = cycles, raws

    whole.transport.write(b"head")
    whole.transport.write(b"body")
    assert whole_raw.written == [b"headbody"]
    assert whole.transport is whole_raw

    stream.transport.write(b"head")
    assert stream_raw.written == []
    closed.transport.write(b"head")
    closed.transport.close()
    assert closed_raw.written == [b"head"]
    assert closed_raw.closing
    gone.transport.write(b"head")
    gone_raw.closing = True
    await asyncio.sleep(0)
    assert stream_raw.written == [b"head"]
    assert stream.transport is stream_raw
    assert gone_raw.written == []


def _uvicorn_cycle(
    loop: asyncio.AbstractEventLoop,
    *,
    keep_alive: bool = True,
    method: str = "POST",
    access_log: bool = False,
) -> tuple[RequestResponseCycle, _ClosingTransport, list[str]]:
    """uvicorn's own response cycle on a recording transport, held as the gateway holds it."""
    raw = _ClosingTransport()
    responded: list[str] = []
    logger = logging.getLogger("test.cycle")
    cycle = RequestResponseCycle(
        scope=cast(
            Any,
            {
                "method": method,
                "type": "http",
                "path": "/v1/chat/completions",
                "raw_path": b"/v1/chat/completions",
                "query_string": b"",
                "http_version": "1.1",
                "client": ("127.0.0.1", 5000),
            },
        ),
        transport=cast(Any, raw),
        flow=FlowControl(cast(Any, raw)),
        logger=logger,
        access_logger=logger,
        access_log=access_log,
        default_headers=[(b"date", b"Sun, 06 Dec 2026 07:00:00 GMT")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: responded.append("done"),
    )
    cycle.transport = cast(Any, HeldHead(cycle, cast(Any, raw), loop))
    return cycle, raw, responded


_ANSWER = b'{"id":"chatcmpl-1"}'
_HEADERS = [
    (b"content-length", b"%d" % len(_ANSWER)),
    (b"content-type", b"application/json"),
    (b"x-request-id", b"req-1"),
]


@pytest.mark.parametrize(
    ("keep_alive", "access_log"), [(True, False), (False, False), (True, True)]
)
async def test_a_whole_answer_is_the_bytes_send_writes_in_one_write(
    keep_alive: bool, access_log: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Written past ``send``, an answer is byte for byte what uvicorn's ``send`` writes for its
    two messages, in one write, and the cycle ends as ``send`` leaves it: complete, its
    request event set, the protocol told, a connection that is not kept alive closed, the
    same access-log line where uvicorn logs one."""
    loop = asyncio.get_running_loop()
    caplog.set_level(logging.INFO, logger="test.cycle")
    through_send, sent_raw, sent_done = _uvicorn_cycle(
        loop, keep_alive=keep_alive, access_log=access_log
    )
    await through_send.send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await through_send.send({"type": "http.response.body", "body": _ANSWER})
    logged = [record.getMessage() for record in caplog.records]
    assert len(logged) == access_log

    direct, raw, done = _uvicorn_cycle(loop, keep_alive=keep_alive, access_log=access_log)
    whole = WholeAnswer.of({"rankgate.response_cycle": weakref.ref(direct)}, direct.send)
    assert whole is not None
    assert whole.write(200, _HEADERS, _ANSWER)
    assert raw.written == [b"".join(sent_raw.written)]
    assert raw.written[0].endswith(b"\r\n\r\n" + _ANSWER)
    assert (b"connection: close" in raw.written[0]) is not keep_alive
    assert direct.transport is cast(Any, raw)
    for cycle in (through_send, direct):
        assert cycle.response_started
        assert cycle.response_complete
        assert cycle.message_event.is_set()
    assert done == sent_done == ["done"]
    assert raw.closing == sent_raw.closing == (not keep_alive)
    await asyncio.sleep(0)
    assert len(raw.written) == 1
    assert [record.getMessage() for record in caplog.records] == logged * 2


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
    cycle, raw, done = _uvicorn_cycle(loop, method="HEAD" if case == "HEAD" else "POST")
    headers = list(_HEADERS)
    scope = {"rankgate.response_cycle": weakref.ref(cycle)}

    async def wrapped(message: Any) -> None:
        await cycle.send(message)

    if case == "wrapped send":
        assert WholeAnswer.of(scope, wrapped) is None
        return
    assert WholeAnswer.of({}, cycle.send) is None
    if case == "started":
        cycle.response_started = True
    elif case == "disconnected":
        cycle.disconnected = True
    elif case == "write paused":
        cycle.flow.write_paused = True
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
    whole = WholeAnswer.of(scope, cycle.send)
    assert whole is not None
    assert not whole.write(200, headers, _ANSWER)
    await asyncio.sleep(0)
    assert raw.written == []
    assert not cycle.response_complete
    assert done == []


async def test_a_whole_answer_follows_what_its_transport_still_holds() -> None:
    """A ``100 Continue`` written in the same tick as the answer (still held for what follows
    it) goes out first, then the answer."""
    cycle, raw, _ = _uvicorn_cycle(asyncio.get_running_loop())
    cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    whole = WholeAnswer.of({"rankgate.response_cycle": weakref.ref(cycle)}, cycle.send)
    assert whole is not None
    assert whole.write(200, _HEADERS, _ANSWER)
    assert raw.written[0] == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert raw.written[1].endswith(_ANSWER)
    await asyncio.sleep(0)
    assert len(raw.written) == 2


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
