"""Input limits applied before a request body is decoded: size and JSON nesting depth.

The body is read chunk by chunk and refused as soon as it passes the limit, so a client that
streams gigabytes (chunked, without Content-Length) costs at most the limit in memory. Nesting
is bounded because the free-form fields (``kv_transfer_params``, tool schemas, ``metadata``)
accept any JSON, and a deep enough document would otherwise end in a RecursionError (a 500)
instead of a 400 that says what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from starlette.requests import Request

from app.errors import ApiError, invalid

# A JSON string, escapes included; removed before counting brackets so that brackets inside
# text do not count as nesting.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


@dataclass(frozen=True, slots=True)
class InputLimits:
    max_body_bytes: int = 32 << 20
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if not 2 <= self.max_json_depth <= 512:
            raise ValueError("max_json_depth must lie in [2, 512]")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def check_depth(body: bytes, limit: int) -> None:
    """A 400 when arrays/objects nest deeper than ``limit``.

    Counting the brackets is a C-speed scan; only a body with more brackets than the limit
    (rare: a token-id batch or a large tool schema) gets the exact, string-aware walk.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    depth = 0
    for match in _BRACKETS.finditer(_STRING.sub(b"", body)):
        if match.group() in b"[{":
            depth += 1
            if depth > limit:
                raise invalid(
                    f"The request body nests JSON arrays/objects deeper than {limit} levels.",
                    code="json_too_deep",
                )
        else:
            depth -= 1
