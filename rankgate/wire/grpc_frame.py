"""gRPC's message framing on HTTP/2 DATA: a compressed-flag byte and a four-byte big-endian
length before every message (gRPC's ``PROTOCOL-HTTP2.md``), as the gateway's client and the mock
engine's server both read and write it."""

from __future__ import annotations

import struct

MESSAGE_HEAD = struct.Struct(">BL")


def grpc_message(payload: bytes) -> bytes:
    """One uncompressed length-prefixed gRPC message."""
    return MESSAGE_HEAD.pack(0, len(payload)) + payload
