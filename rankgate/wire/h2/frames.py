"""HTTP/2 frame types, flags, settings and error codes (RFC 9113 section 6-7), and packing."""

from __future__ import annotations

import struct
from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9

END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
LARGEST_MAX_FRAME = (1 << 24) - 1
MAX_WINDOW = (1 << 31) - 1
MAX_STREAM_ID = (1 << 31) - 1


class ErrorCode(IntEnum):
    """RST_STREAM and GOAWAY error codes (RFC 9113 section 7)."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


FRAME_HEAD = struct.Struct(">HBBBL")
SETTING = struct.Struct(">HL")
U32 = struct.Struct(">L")
GOAWAY_HEAD = struct.Struct(">LL")


def frame_head(kind: int, flags: int, stream_id: int, size: int) -> bytes:
    return FRAME_HEAD.pack(size >> 8, size & 0xFF, kind, flags, stream_id)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return FRAME_HEAD.pack(size >> 8, size & 0xFF, kind, flags, stream_id) + payload


def settings_frame(values: tuple[tuple[int, int], ...]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(SETTING.pack(key, value) for key, value in values))
