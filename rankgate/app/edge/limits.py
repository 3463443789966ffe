"""Input limits applied before a request body is decoded: size, JSON shape, content type.

The body is read chunk by chunk and refused as soon as it passes the limit, so a client that
streams gigabytes (chunked, without Content-Length) costs at most the limit in memory.

What a body costs to decode and to walk grows with its structure, not its size, so the shape
(:mod:`rankgate.app.edge.json_shape`) is checked before decoding: nesting depth, because the
free-form fields (``kv_transfer_params``, tool schemas, ``chat_template_kwargs``) accept any JSON
and a deep document overflows whatever walks it later (a template, protobuf, a recursive converter);
the number of arrays/objects and of items, because decoding builds one Python object per
item and holds the event loop while it does. With these bounds the decode of any accepted
body is short; the scan itself is linear, never backtracks, and runs on a worker thread with
the GIL released when the body is large.

JSON that a client embeds in a string (tool-call ``arguments``, ``guided_json``) reaches a
template or the engine the same way and gets the same depth check (:func:`check_json_text`);
``kv_transfer_params`` must also fit the engine's protobuf decoder (:func:`check_engine_json`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive

from rankgate.app.edge.json_shape import JsonShape, could_exceed, json_shape
from rankgate.app.errors import ApiError, client_gone, invalid
from rankgate.app.serving.offload import offload

log = logging.getLogger(__name__)

# Bodies larger than this are scanned on a worker thread (numpy releases the GIL there).
SCAN_OFFLOAD_BYTES = 1 << 20
# What vLLM's protobuf decoders accept in a google.protobuf.Struct: upb and prost stop at 100
# nested messages, and every JSON level costs two or three of them (Value, then Struct and its
# map entry, or ListValue); 16 JSON levels leave room for the request around the Struct.
ENGINE_JSON_DEPTH = 16
# Arrays, objects and scalars in one pass-through structure (kv_transfer_params): a NIXL
# handoff lists one block id per KV block (8192 for a 128k-token prompt in 16-token blocks).
# protobuf's Struct is filled in Python, value by value, on the event loop.
ENGINE_JSON_NODES = 1 << 15
_JSON_TYPES = "application/json"


@dataclass(frozen=True, slots=True)
class InputLimits:
    max_body_bytes: int = 32 << 20
    max_json_depth: int = 64
    # Arrays and objects in one body.
    max_json_containers: int = 1 << 17
    # Array elements, object members and string escapes in one body.
    max_json_items: int = 1 << 20
    # Engine streams one request may open: its prompts times n.
    max_fanout: int = 256
    # A field no schema knows is a 400 instead of ignored (rankgate/app/schemas/unknown_fields.py).
    reject_unknown_fields: bool = False

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if not 2 <= self.max_json_depth <= 512:
            raise ValueError("max_json_depth must lie in [2, 512]")
        if self.max_json_containers < 16:
            raise ValueError("max_json_containers must be at least 16")
        if self.max_json_items < 1024:
            raise ValueError("max_json_items must be at least 1024")
        if self.max_fanout < 1:
            raise ValueError("max_fanout must be at least 1")


def check_fanout(prompts: int, n: int, limits: InputLimits) -> None:
    """A 400 when a request would open more engine streams (prompts times choices) than
    ``max_fanout``: each is a request the engine runs, and they are admitted together."""
    streams = prompts * n
    if streams > limits.max_fanout:
        raise invalid(
            f"The request fans out to {streams} engine requests ({prompts} prompts x n={n}); "
            f"at most {limits.max_fanout} are allowed. Lower 'n' or send fewer prompts at once.",
            "n",
            code="too_many_choices",
        )


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")


def check_content_type(declared: str | None) -> None:
    """A 415 unless the body is declared JSON (``declared``: its ``Content-Type``): a
    browser's cross-site form or ``text/plain`` post cannot declare it without a CORS
    preflight, which the gateway does not grant."""
    media = (declared or "").partition(";")[0].strip().lower()
    if media == _JSON_TYPES or (media.startswith("application/") and media.endswith("+json")):
        return
    shown = f"'{declared}'" if declared else "none"
    raise ApiError(
        415,
        f"Unsupported content type {shown}: send the body as JSON with "
        "'Content-Type: application/json'.",
        code="unsupported_media_type",
    )


async def read_body(receive: Receive, declared_length: int | None, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed ``limit`` bytes: at once when
    its ``Content-Length`` (``declared_length``) says so.

    A client that hangs up during its upload ends the request as a client disconnect (499),
    which is its own doing, not the gateway's.
    """
    if declared_length is not None and declared_length > limit:
        raise too_large(limit)
    # The ASGI messages read directly, not through ``request.stream()``: an async generator
    # per request costs more than the loop. Nothing reads the body a second time.
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            log.info("the client hung up after sending %d bytes of its request body", size)
            raise client_gone("the client closed the connection during its upload")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


async def check_shape(body: bytes, limits: InputLimits) -> None:
    """A 400 for nesting past ``max_json_depth``, a 413 for more containers or items than
    allowed; large bodies are measured off the event loop."""
    depth, containers, items = (
        limits.max_json_depth,
        limits.max_json_containers,
        limits.max_json_items,
    )
    measure = _measure_with(limits)
    if len(body) > SCAN_OFFLOAD_BYTES:
        shape = await offload(len(body), measure, body)
    elif could_exceed(body, depth, containers, items):
        shape = measure(body)
    else:
        return
    _refuse(shape, limits)


def _measure_with(limits: InputLimits) -> Any:
    def measure(body: bytes) -> JsonShape:
        if not could_exceed(
            body, limits.max_json_depth, limits.max_json_containers, limits.max_json_items
        ):
            return JsonShape(depth=0, containers=0, items=0)
        return json_shape(
            body,
            depth_limit=limits.max_json_depth,
            container_limit=limits.max_json_containers,
            item_limit=limits.max_json_items,
        )

    return measure


def _refuse(shape: JsonShape, limits: InputLimits, param: str | None = None) -> None:
    where = f"'{param}'" if param else "The request body"
    if shape.depth > limits.max_json_depth:
        raise invalid(
            f"{where} nests JSON arrays/objects deeper than {limits.max_json_depth} levels.",
            param,
            code="json_too_deep",
        )
    if shape.containers > limits.max_json_containers:
        raise ApiError(
            413,
            f"{where} holds more than {limits.max_json_containers} JSON arrays/objects.",
            param=param,
            code="json_too_complex",
        )
    if shape.items > limits.max_json_items:
        raise ApiError(
            413,
            f"{where} holds more than {limits.max_json_items} JSON items (array elements, "
            "object members and string escapes).",
            param=param,
            code="json_too_complex",
        )


def check_depth(body: bytes, limit: int) -> None:
    """A 400 when arrays/objects nest deeper than ``limit`` (strings are not nesting)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    if json_shape(body, depth_limit=limit).depth > limit:
        raise invalid(
            f"The request body nests JSON arrays/objects deeper than {limit} levels.",
            code="json_too_deep",
        )


def check_json_text(text: str, param: str, limits: InputLimits) -> None:
    """The body's limits for JSON a client sent inside a string (it is decoded later, by a
    template or by the engine, where its depth would overflow them)."""
    data = text.encode()
    if could_exceed(data, limits.max_json_depth, limits.max_json_containers, limits.max_json_items):
        _refuse(_measure_with(limits)(data), limits, param)


def check_engine_json(value: Mapping[str, Any], param: str) -> None:
    """A 400 unless ``value`` fits what vLLM's protobuf decoders accept as a Struct
    (:data:`ENGINE_JSON_DEPTH` levels, :data:`ENGINE_JSON_NODES` values), checked before the
    request is sent. The walk goes level by level and stops at the first one too many."""
    nodes = 0
    level: list[Any] = [value]
    depth = 1
    while level:
        if depth > ENGINE_JSON_DEPTH:
            raise invalid(
                f"'{param}' nests deeper than {ENGINE_JSON_DEPTH} levels, more than the engine "
                "accepts.",
                param,
                code="json_too_deep",
            )
        below: list[Any] = []
        for container in level:
            children = list(container.values()) if isinstance(container, Mapping) else container
            nodes += len(children)
            if nodes > ENGINE_JSON_NODES:
                raise invalid(
                    f"'{param}' holds more than {ENGINE_JSON_NODES} values, more than the "
                    "engine accepts in one structure.",
                    param,
                    code="json_too_complex",
                )
            below.extend(c for c in children if isinstance(c, Mapping | list | tuple))
        level = below
        depth += 1
