"""The HTTP/2 core against python-hyper's ``h2``: the same frames, the same verdicts.

Hypothesis writes frame sequences (well-formed, off by one, and garbage) as a peer would send
them, to a client and to a server; both ``h2`` and the core get the same bytes in the same
random chunks. Two properties:

- whatever ``h2`` refuses as a protocol error, the core refuses too (a connection error, or a
  stream error where RFC 9113 asks for one and ``h2`` ends the connection); ``h2`` may notice
  a bad frame head a chunk earlier, before the frame's body arrived;
- up to the first refusal, both report the same events: header blocks, DATA with its flow-
  controlled length, stream ends, resets by the peer and GOAWAY.

The core may refuse what ``h2`` lets pass, where RFC 9113 says so or a peer is plainly broken:
RST_STREAM or HEADERS on a stream never opened, HEADERS padding longer than what remains
after the priority fields, trailers with a pseudo-header, frames on a stream after the peer's
own RST_STREAM (a connection error, not a stream error), a first frame that is not SETTINGS,
and header text that is not UTF-8.
``h2`` gets every WINDOW_UPDATE with its reserved bit cleared: ``hyperframe`` refuses an
increment with that bit set, where RFC 9113 section 6.9 says it is ignored (the core gets the
bytes as sent, and must ignore it).
``h2`` runs with header validation off (the roles check gRPC's headers themselves) and is fed
nothing after the first GOAWAY: it closes at once where RFC 9113 section 6.8 lets the streams
below the last id finish, which the roles rely on. Nor does it get ALTSVC frames (below).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rankgate.wire.h2 import frames
from rankgate.wire.h2.connection import H2Connection, H2Stream
from rankgate.wire.h2.errors import H2ConnectionError, H2StreamError

EXAMPLES = int(os.environ.get("RANKGATE_H2_FUZZ_EXAMPLES", "250"))
# Ids the sequences use: the ones the client opened, some it did not, even ones, stream 0.
STREAM_IDS = (0, 1, 3, 5, 7, 2, 9, frames.MAX_STREAM_ID)
CLIENT_OPENS = (1, 3, 5)

Event = tuple[Any, ...]


# ---------------------------------------------------------------- the core, recording


class _Stream(H2Stream):
    """Records what the core reports. A client stream ends with its response, as the
    client role's do (its request went out whole); a server stream stays half-closed."""

    __slots__ = ("conn", "events")

    def __init__(self, conn: _Core) -> None:
        super().__init__()
        self.conn = conn
        self.events = conn.events

    def on_headers(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        self.events.append(("headers", self.stream_id, _encoded(headers)))
        if end_stream:
            self._end()

    def on_data(self, data: bytes, flow: int, end_stream: bool) -> None:
        self.events.append(("data", self.stream_id, bytes(data), flow))
        if end_stream:
            self._end()

    def _end(self) -> None:
        self.events.append(("end", self.stream_id))
        if self.conn.client:
            self.conn.close_stream(self)

    def on_reset(self, code: int) -> None:
        self.events.append(("reset", self.stream_id, code))

    def on_stream_error(self, error: H2StreamError) -> None:
        self.events.append(("refused", self.stream_id, error.message))


class _Core(H2Connection[_Stream]):
    def __init__(self, client: bool) -> None:
        super().__init__(client=client, settings=((frames.SETTINGS_ENABLE_PUSH, 0),))
        self.events: list[Event] = []

    def on_new_stream(self, stream_id: int, headers: list[tuple[str, str]], end: bool) -> None:
        stream = _Stream(self)
        self.add_stream(stream, stream_id, end)
        self.events.append(("headers", stream_id, _encoded(headers)))
        if end:
            self.events.append(("end", stream_id))

    def on_goaway(self, last_stream_id: int, code: int, debug: bytes) -> None:
        self.events.append(("goaway", last_stream_id, code, debug))


def _encoded(headers: list[tuple[str, str]]) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((name.encode(), value.encode()) for name, value in headers)


# ---------------------------------------------------------------- h2, the reference


def _reference(client: bool) -> h2.connection.H2Connection:
    config = h2.config.H2Configuration(
        client_side=client,
        header_encoding=None,
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
        validate_outbound_headers=False,
    )
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})
    return conn


def _events_of(h2_events: list[Any]) -> list[Event]:
    out: list[Event] = []
    for event in h2_events:
        if isinstance(
            event,
            (
                h2.events.RequestReceived,
                h2.events.ResponseReceived,
                h2.events.TrailersReceived,
                h2.events.InformationalResponseReceived,
            ),
        ):
            headers = tuple((bytes(n), bytes(v)) for n, v in event.headers or ())
            out.append(("headers", event.stream_id, headers))
        elif isinstance(event, h2.events.DataReceived):
            out.append(
                ("data", event.stream_id, bytes(event.data or b""), event.flow_controlled_length)
            )
        elif isinstance(event, h2.events.StreamEnded):
            out.append(("end", event.stream_id))
        elif isinstance(event, h2.events.StreamReset):
            if event.remote_reset:
                out.append(("reset", event.stream_id, int(event.error_code or 0)))
            else:
                out.append(("refused", event.stream_id, "h2"))
        elif isinstance(event, h2.events.ConnectionTerminated):
            debug = event.additional_data or b""
            out.append(("goaway", event.last_stream_id, int(event.error_code or 0), debug))
    return out


# ---------------------------------------------------------------- frame sequences


@dataclass
class _Sequence:
    """Frames as a peer sends them, built in order with one HPACK encoder."""

    client: bool
    # For h2: WINDOW_UPDATE increments without their reserved bit (see the module's text).
    clear_reserved: bool = False
    encoder: hpack.Encoder = field(default_factory=hpack.Encoder)
    parts: list[bytes] = field(default_factory=list)

    def frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.clear_reserved and kind == frames.WINDOW_UPDATE and len(payload) == 4:
            payload = bytes((payload[0] & 0x7F,)) + payload[1:]
        self.parts.append(frames.frame(kind, flags, stream_id, payload))


_names = st.sampled_from(["grpc-status", "grpc-message", "content-type", "x-a", "te", "a"])
_values = st.text(alphabet="abc019 %-", max_size=12)
_header_lists = st.lists(st.tuples(_names, _values), max_size=4)
# Mostly the streams in use, so sequences get deep into their states; sometimes any id.
_open_ids = st.sampled_from(CLIENT_OPENS)
_ids = st.one_of(_open_ids, _open_ids, _open_ids, st.sampled_from(STREAM_IDS))
_settings_ids = st.sampled_from([1, 2, 3, 4, 5, 6, 0x7, 0xFF])
_settings_values = st.one_of(
    st.sampled_from([0, 1, 2, 16_383, 16_384, 16_385, 65_535, (1 << 24) - 1, 1 << 24]),
    st.sampled_from([(1 << 31) - 1, 1 << 31, (1 << 32) - 1]),
    st.integers(0, (1 << 32) - 1),
)
# Every type of RFC 9113 and a few unknown ones, but not ALTSVC (0xA, RFC 7838): h2 refuses a
# malformed one, where that RFC says to ignore it.
_raw_kinds = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0xB, 0xC, 0x10, 0xFF])
_window_increments = st.one_of(
    st.sampled_from([0, 1, 65_535, (1 << 31) - 1, 1 << 31]), st.integers(0, (1 << 32) - 1)
)


# What opens a header block: a response (final or 1xx) towards a client, a request towards
# a server (h2 refuses a request with a :status even with its validation off).
_RESPONSE_STARTS: tuple[list[tuple[str, str]], ...] = (
    [(":status", "200")],
    [(":status", "100")],
    [],
)
_REQUEST_STARTS: tuple[list[tuple[str, str]], ...] = ([(":method", "POST"), (":path", "/a")], [])


@st.composite
def _headers_op(draw: st.DrawFn, client: bool) -> tuple[Any, ...]:
    pairs = draw(_header_lists)
    first = draw(st.sampled_from(_RESPONSE_STARTS if client else _REQUEST_STARTS))
    return (
        "headers",
        draw(_ids),
        first + pairs,
        draw(st.booleans()),  # END_STREAM
        draw(st.integers(0, 3)),  # CONTINUATIONs to split into
        draw(st.one_of(st.none(), st.integers(0, 8))),  # padding
        draw(st.booleans()),  # priority fields
        draw(st.booleans()),  # huffman
    )


_common_ops = (
    st.tuples(
        st.just("data"),
        _ids,
        st.binary(max_size=40),
        st.booleans(),
        st.one_of(st.none(), st.none(), st.integers(0, 8)),
    ),
    st.tuples(st.just("window"), _ids, st.integers(1, 1 << 16), st.just(4)),
    st.tuples(st.just("settings"), st.lists(st.tuples(st.just(4), st.integers(0, 1 << 17)))),
    st.tuples(st.just("ping"), st.booleans(), st.just(8), st.just(0)),
    st.tuples(st.just("rst"), _ids, st.integers(0, 14), st.just(4)),
)
_frame_ops = (
    st.tuples(
        st.just("data"),
        _ids,
        st.binary(max_size=40),
        st.booleans(),
        st.one_of(st.none(), st.integers(0, 50)),
    ),
    st.tuples(
        st.just("settings"), st.lists(st.tuples(_settings_ids, _settings_values), max_size=3)
    ),
    st.tuples(st.just("settings-ack"), st.sampled_from([b"", b"x"])),
    st.tuples(st.just("window"), _ids, _window_increments, st.sampled_from([4, 4, 4, 3])),
    st.tuples(st.just("rst"), _ids, st.integers(0, 14), st.sampled_from([4, 4, 5])),
    st.tuples(st.just("ping"), st.booleans(), st.sampled_from([8, 8, 7]), _ids),
    st.tuples(st.just("goaway"), _ids, st.integers(0, 13), st.binary(max_size=4)),
    st.tuples(st.just("priority"), _ids, st.integers(0, 9), st.sampled_from([5, 5, 4])),
    st.tuples(st.just("push"), _ids),
    st.tuples(st.just("unknown"), _ids, st.binary(max_size=8)),
    st.tuples(st.just("orphan-continuation"), _ids, st.booleans()),
    st.tuples(st.just("raw"), _raw_kinds, st.integers(0, 255), _ids, st.binary(max_size=20)),
    st.tuples(st.just("big"), _ids),
)
# Well-formed frames far more often than anything at all.
_client_ops = st.one_of(
    *[_headers_op(True)] * 5, *_common_ops * 4, st.one_of(_headers_op(True), *_frame_ops)
)
_server_ops = st.one_of(
    *[_headers_op(False)] * 5, *_common_ops * 4, st.one_of(_headers_op(False), *_frame_ops)
)


def _build(
    client: bool, ops: list[tuple[Any, ...]], opened: bool = False, for_h2: bool = False
) -> bytes:
    """The bytes of ``ops``; with ``opened``, each stream in use first gets its header
    block, so that more of the sequence reaches DATA, trailers and the windows."""
    seq = _Sequence(client, clear_reserved=for_h2)
    # Each end's preface: the server's SETTINGS, or the client's magic and SETTINGS; then
    # the ACK of ours, so both implementations use the settings they announced.
    if not client:
        seq.parts.append(frames.PREFACE)
    seq.frame(frames.SETTINGS, 0, 0, b"")
    seq.frame(frames.SETTINGS, frames.ACK, 0, b"")
    if opened:
        start = _RESPONSE_STARTS[0] if client else _REQUEST_STARTS[0]
        for sid in CLIENT_OPENS:
            seq.frame(frames.HEADERS, frames.END_HEADERS, sid, seq.encoder.encode(start))
    for op in ops:
        kind = op[0]
        if kind == "headers":
            _, sid, pairs, end, splits, pad, priority, huffman = op
            block = bytes(seq.encoder.encode(pairs, huffman=huffman))
            cut = [len(block) * i // (splits + 1) for i in range(splits + 2)]
            pieces = [block[cut[i] : cut[i + 1]] for i in range(splits + 1)]
            flags = frames.END_STREAM if end else 0
            head = pieces[0]
            if priority:
                flags |= frames.PRIORITY_FLAG
                head = struct.pack(">LB", 0x80000000 | 3, 15) + head
            if pad is not None:
                flags |= frames.PADDED
                head = bytes((pad,)) + head + b"\x00" * min(pad, 4)
            if len(pieces) == 1:
                flags |= frames.END_HEADERS
            seq.frame(frames.HEADERS, flags, sid, head)
            for i, piece in enumerate(pieces[1:], 1):
                last = frames.END_HEADERS if i == len(pieces) - 1 else 0
                seq.frame(frames.CONTINUATION, last, sid, piece)
        elif kind == "data":
            _, sid, data, end, pad = op
            flags = frames.END_STREAM if end else 0
            if pad is not None:
                flags |= frames.PADDED
                data = bytes((pad,)) + data + b"\x00" * min(pad, 10)
            seq.frame(frames.DATA, flags, sid, data)
        elif kind == "settings":
            payload = b"".join(frames.SETTING.pack(key, value) for key, value in op[1])
            seq.frame(frames.SETTINGS, 0, 0, payload)
        elif kind == "settings-ack":
            seq.frame(frames.SETTINGS, frames.ACK, 0, op[1])
        elif kind == "window":
            _, sid, increment, size = op
            seq.frame(frames.WINDOW_UPDATE, 0, sid, struct.pack(">L", increment)[:size])
        elif kind == "rst":
            _, sid, code, size = op
            seq.frame(frames.RST_STREAM, 0, sid, struct.pack(">L", code) + b"\x00" * (size - 4))
        elif kind == "ping":
            _, ack, size, sid = op
            seq.frame(frames.PING, frames.ACK if ack else 0, sid if sid == 1 else 0, b"p" * size)
        elif kind == "goaway":
            _, sid, code, debug = op
            seq.frame(frames.GOAWAY, 0, 0, struct.pack(">LL", sid, code) + debug)
        elif kind == "priority":
            _, sid, depends, size = op
            seq.frame(frames.PRIORITY, 0, sid, struct.pack(">LB", depends, 7)[:size])
        elif kind == "push":
            seq.frame(frames.PUSH_PROMISE, frames.END_HEADERS, op[1], struct.pack(">L", 2))
        elif kind == "unknown":
            seq.frame(0x20, 0, op[1], op[2])
        elif kind == "orphan-continuation":
            seq.frame(frames.CONTINUATION, frames.END_HEADERS if op[2] else 0, op[1], b"\x88")
        elif kind == "raw":
            _, kind_byte, flags, sid, payload = op
            seq.frame(kind_byte, flags, sid, payload)
        elif kind == "big":
            seq.frame(frames.DATA, 0, op[1], b"\x00" * (frames.DEFAULT_MAX_FRAME + 1))
    return b"".join(seq.parts)


def _until_goaway(client: bool, ops: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    for at, op in enumerate(ops):
        if op[0] == "goaway":
            return ops[: at + 1]
    return ops


def _chunks(data: bytes, sizes: list[int]) -> list[bytes]:
    out, at = [], 0
    for size in sizes:
        if at >= len(data):
            break
        out.append(data[at : at + size])
        at += size
    if at < len(data):
        out.append(data[at:])
    return out


# ---------------------------------------------------------------- the properties


@dataclass
class _Run:
    events: list[list[Event]]  # per chunk
    refused_at: int | None  # the chunk whose bytes were refused first
    reason: str = ""


def _run_reference(client: bool, chunks: list[bytes]) -> _Run:
    conn = _reference(client)
    if client:
        for sid in CLIENT_OPENS:
            conn.send_headers(sid, [(":method", "POST"), (":path", "/")], end_stream=True)
    per_chunk: list[list[Event]] = []
    for at, chunk in enumerate(chunks):
        try:
            events = _events_of(conn.receive_data(chunk))
        except h2.exceptions.ProtocolError as error:
            return _Run(per_chunk, at, f"{type(error).__name__}: {error}")
        per_chunk.append(events)
        if any(event[0] == "refused" for event in events):
            return _Run(per_chunk, at)
    return _Run(per_chunk, None)


def _run_core(client: bool, chunks: list[bytes]) -> _Run:
    core = _Core(client)
    core.initiate()
    if client:
        for sid in CLIENT_OPENS:
            assert core.open_stream(_Stream(core)) == sid
    per_chunk: list[list[Event]] = []
    for at, chunk in enumerate(chunks):
        seen = len(core.events)
        try:
            core.receive(chunk)
        except H2ConnectionError as error:
            return _Run(per_chunk, at, f"{error.code.name}: {error}")
        events = core.events[seen:]
        per_chunk.append(events)
        if any(event[0] == "refused" for event in events):
            return _Run(per_chunk, at)
    return _Run(per_chunk, None)


def _check(client: bool, ops: list[tuple[Any, ...]], sizes: list[int], opened: bool) -> None:
    ops = _until_goaway(client, ops)
    chunks = _chunks(_build(client, ops, opened), sizes)
    reference = _run_reference(client, _chunks(_build(client, ops, opened, for_h2=True), sizes))
    core = _run_core(client, chunks)
    if reference.refused_at is not None:
        why = f"h2 refused ({reference.reason}) {ops!r}"
        assert core.refused_at is not None, f"the core accepted what {why}"
    agreed = min(
        len(chunks) if reference.refused_at is None else reference.refused_at,
        len(chunks) if core.refused_at is None else core.refused_at,
    )
    assert core.events[:agreed] == reference.events[:agreed]


_fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_sizes = st.lists(st.integers(1, 80), max_size=40)


@_fuzz
@given(st.lists(_client_ops, max_size=14), _sizes, st.booleans())
# A zero WINDOW_UPDATE on a stream both ends have closed (found by CI).
@example([("data", 3, b"", True, None), ("window", 3, 0, 4)], [], True)
# An increment of 1 with the reserved bit set: h2 alone refuses it (found by a local run).
@example([("raw", 8, 0, 1, b"\x80\x00\x00\x01")], [], False)
def test_the_client_end_agrees_with_h2(
    ops: list[tuple[Any, ...]], sizes: list[int], opened: bool
) -> None:
    _check(True, ops, sizes, opened)


@_fuzz
@given(st.lists(_server_ops, max_size=14), _sizes, st.booleans())
def test_the_server_end_agrees_with_h2(
    ops: list[tuple[Any, ...]], sizes: list[int], opened: bool
) -> None:
    _check(False, ops, sizes, opened)
