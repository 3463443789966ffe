"""The sans-IO core on its own: bytes in, frames out, hooks called (sidecar.h2.connection).

What the differential suite cannot ask ``h2`` about: the core's send side (windows, frame
size, queued DATA and its drain), stream ids running out, late frames after our own reset,
the connection window re-opened by the core, and the limits on a header block.
"""

from __future__ import annotations

import struct

import hpack
import pytest

from rankgate.wire.h2 import frames
from rankgate.wire.h2.connection import MAX_HEADER_FRAMES, H2Connection, H2Stream
from rankgate.wire.h2.errors import H2ConnectionError, H2StreamError, StreamIdsExhausted

_HEAD = struct.Struct(">HBBBL")


class _Stream(H2Stream):
    __slots__ = ("got",)

    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[object, ...]] = []

    def on_headers(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        self.got.append(("headers", tuple(headers), end_stream))

    def on_data(self, data: bytes, flow: int, end_stream: bool) -> None:
        self.got.append(("data", data, flow, end_stream))

    def on_reset(self, code: int) -> None:
        self.got.append(("reset", code))

    def on_stream_error(self, error: H2StreamError) -> None:
        self.got.append(("error", error.code))

    def on_drained(self) -> None:
        self.got.append(("drained",))


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, at = [], 0
    if data.startswith(frames.PREFACE):
        at = len(frames.PREFACE)
    while at < len(data):
        hi, lo, kind, flags, sid = _HEAD.unpack_from(data, at)
        size = (hi << 8) | lo
        out.append((kind, flags, sid, data[at + 9 : at + 9 + size]))
        at += 9 + size
    return out


def _client(**options: int) -> tuple[H2Connection[_Stream], _Stream]:
    conn: H2Connection[_Stream] = H2Connection(client=True, **options)  # type: ignore[arg-type]
    conn.initiate()
    conn.receive(frames.settings_frame(()))
    stream = _Stream()
    conn.open_stream(stream)
    conn.data_to_send()
    return conn, stream


def _ok() -> bytes:
    return frames.frame(
        frames.HEADERS, frames.END_HEADERS, 1, hpack.Encoder().encode([(":status", "200")])
    )


def test_the_preface_and_settings_go_out_first() -> None:
    conn: H2Connection[_Stream] = H2Connection(
        client=True,
        settings=((frames.SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20),),
        connection_window=1 << 24,
    )
    conn.initiate()
    data = conn.data_to_send()
    assert data.startswith(frames.PREFACE)
    (settings, window) = _frames(data)
    assert settings[:3] == (frames.SETTINGS, 0, 0)
    assert frames.SETTING.unpack(settings[3]) == (frames.SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20)
    assert window[0] == frames.WINDOW_UPDATE
    assert struct.unpack(">L", window[3])[0] == (1 << 24) - frames.DEFAULT_WINDOW


def test_a_server_refuses_a_wrong_preface_with_goaway() -> None:
    conn: H2Connection[_Stream] = H2Connection(client=False)
    with pytest.raises(H2ConnectionError) as caught:
        conn.receive(b"GET / HTTP/1.1\r\n\r\n")
    assert caught.value.code is frames.ErrorCode.PROTOCOL_ERROR
    (goaway,) = _frames(conn.data_to_send())
    assert goaway[0] == frames.GOAWAY
    assert struct.unpack(">LL", goaway[3][:8]) == (0, frames.ErrorCode.PROTOCOL_ERROR)
    conn.receive(b"more")  # a closed connection reads nothing more


def test_send_data_waits_for_window_and_frame_size_then_drains() -> None:
    conn, stream = _client()
    body = bytes(range(256)) * 400  # 102,400 bytes: past the 65,535 windows
    assert not conn.send_data(stream, body, end_stream=True, prefix=b"\x00")
    sent = _frames(conn.data_to_send())
    assert all(len(payload) <= frames.DEFAULT_MAX_FRAME for _, _, _, payload in sent)
    assert sum(len(p) for *_, p in sent) == frames.DEFAULT_WINDOW
    assert not any(flags & frames.END_STREAM for _, flags, _, _ in sent)
    grow = struct.pack(">L", 1 << 20)
    conn.receive(frames.frame(frames.WINDOW_UPDATE, 0, 0, grow))
    assert conn.data_to_send() == b""  # the stream's own window is still shut
    conn.receive(frames.frame(frames.WINDOW_UPDATE, 0, 1, grow))
    rest = _frames(conn.data_to_send())
    assert b"".join(p for *_, p in sent + rest) == b"\x00" + body
    assert rest[-1][1] & frames.END_STREAM
    assert stream.got == [("drained",)]


def test_streams_waiting_on_the_connection_window_take_turns_a_frame_each() -> None:
    conn: H2Connection[_Stream] = H2Connection(client=True)
    conn.initiate()
    # Large stream windows, the default connection window: the connection is the bottleneck.
    conn.receive(frames.settings_frame(((frames.SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20),)))
    long_a, long_b, short = _Stream(), _Stream(), _Stream()
    for stream in (long_a, long_b, short):
        conn.open_stream(stream)
    conn.data_to_send()
    prompt = bytes(200_000)
    assert not conn.send_data(long_a, prompt, end_stream=True)
    assert not conn.send_data(long_b, prompt, end_stream=True)
    assert not conn.send_data(short, b"q" * 100, end_stream=True)
    assert sum(len(p) for *_, p in _frames(conn.data_to_send())) == frames.DEFAULT_WINDOW

    room = 2 * frames.DEFAULT_MAX_FRAME + 100 + 5_000
    conn.receive(frames.frame(frames.WINDOW_UPDATE, 0, 0, struct.pack(">L", room)))
    sent = [(sid, len(payload), flags) for _, flags, sid, payload in _frames(conn.data_to_send())]
    # One frame of each long prompt, then the short request whole, then the rest of the room.
    ids = (long_a.stream_id, long_b.stream_id, short.stream_id)
    assert sent == [
        (ids[0], frames.DEFAULT_MAX_FRAME, 0),
        (ids[1], frames.DEFAULT_MAX_FRAME, 0),
        (ids[2], 100, frames.END_STREAM),
        (ids[0], 5_000, 0),
    ]
    assert short.got == [("drained",)]
    assert long_a.got == long_b.got == []


def test_a_larger_peer_frame_size_is_used_and_headers_are_split_at_it() -> None:
    conn, stream = _client()
    conn.receive(frames.settings_frame(((frames.SETTINGS_MAX_FRAME_SIZE, 20_000),)))
    conn.data_to_send()
    conn.receive(frames.frame(frames.WINDOW_UPDATE, 0, 0, struct.pack(">L", 1 << 20)))
    conn.send_headers(1, b"h" * 45_000, end_stream=False)
    kinds = [(kind, flags, len(p)) for kind, flags, _, p in _frames(conn.data_to_send())]
    assert kinds == [
        (frames.HEADERS, 0, 20_000),
        (frames.CONTINUATION, 0, 20_000),
        (frames.CONTINUATION, frames.END_HEADERS, 5_000),
    ]
    assert conn.send_data(stream, b"d" * 20_000)


def test_the_core_reopens_the_connection_window_itself() -> None:
    conn, stream = _client(connection_window=100_000, connection_credit_step=30_000)
    conn.receive(_ok())
    conn.data_to_send()
    chunk = frames.frame(frames.DATA, 0, 1, b"x" * 10_000)
    conn.receive(chunk * 2)
    assert conn.data_to_send() == b""
    conn.receive(chunk)
    (update,) = _frames(conn.data_to_send())
    assert update[:3] == (frames.WINDOW_UPDATE, 0, 0)
    assert struct.unpack(">L", update[3])[0] == 30_000
    # The stream's window is the role's to re-open: past it is an error.
    assert stream.recv_window == frames.DEFAULT_WINDOW - 30_000
    with pytest.raises(H2ConnectionError, match="stream window"):
        conn.receive(chunk * 4)


def test_stream_ids_run_out_at_2_to_the_31_minus_1() -> None:
    conn, _ = _client()
    conn.next_stream_id = frames.MAX_STREAM_ID
    assert conn.open_stream(_Stream()) == frames.MAX_STREAM_ID
    assert not conn.can_open
    with pytest.raises(StreamIdsExhausted):
        conn.open_stream(_Stream())


def test_late_frames_after_our_reset_are_ignored_but_not_after_an_end() -> None:
    conn, stream = _client()
    conn.receive(_ok())
    conn.reset_stream(stream, frames.ErrorCode.CANCEL)
    conn.receive(frames.frame(frames.DATA, 0, 1, b"in flight"))
    assert stream.got == [("headers", ((":status", "200"),), False)]
    other = _Stream()
    assert conn.open_stream(other) == 3
    block = hpack.Encoder().encode([(":status", "200")])
    conn.receive(frames.frame(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, 3, block))
    conn.close_stream(other)
    with pytest.raises(H2ConnectionError) as caught:
        conn.receive(frames.frame(frames.DATA, 0, 3, b"after the end"))
    assert caught.value.code is frames.ErrorCode.STREAM_CLOSED


def test_data_before_headers_and_trailers_that_do_not_end_are_stream_errors() -> None:
    conn, stream = _client()
    conn.receive(frames.frame(frames.DATA, 0, 1, b"early"))
    assert stream.got == [("error", frames.ErrorCode.PROTOCOL_ERROR)]
    assert _frames(conn.data_to_send())[0][:3] == (frames.RST_STREAM, 0, 1)
    assert 1 not in conn.streams


def test_a_header_block_in_too_many_frames_is_refused() -> None:
    conn, _ = _client()
    flood = frames.frame(frames.HEADERS, 0, 1, b"\x88") + frames.frame(
        frames.CONTINUATION, 0, 1, b""
    ) * (MAX_HEADER_FRAMES - 1)
    conn.receive(flood)
    with pytest.raises(H2ConnectionError, match="too many frames") as caught:
        conn.receive(frames.frame(frames.CONTINUATION, 0, 1, b""))
    assert caught.value.code is frames.ErrorCode.ENHANCE_YOUR_CALM
