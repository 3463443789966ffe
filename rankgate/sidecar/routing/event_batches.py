"""vLLM's KV-event batches as its publisher encodes them (msgpack), read into events.

A batch is an ``EventBatch``: its publish time and its events, encoded as an array or as a
map depending on the publisher's settings, and each event likewise as an array led by its
type tag or as a map with ``type``. Both shapes are read into one: ``(type, fields)``, the
fields by vLLM's names. Whatever is not one of those shapes is a :class:`MalformedBatch`, for
the intake to count and drop.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedBatch(Exception):
    """A payload that is not an EventBatch in either known shape."""


def batch_events(decoded: Any) -> tuple[float, list[Any]]:
    """(publish time, events) of an EventBatch encoded as an array or as a map."""
    if isinstance(decoded, list | tuple) and len(decoded) >= 2:
        ts, events = decoded[0], decoded[1]
    elif isinstance(decoded, dict):
        ts, events = decoded.get("ts", 0.0), decoded.get("events")
    else:
        raise MalformedBatch(f"batch is a {type(decoded).__name__}")
    if not isinstance(events, list | tuple):
        raise MalformedBatch("batch has no event list")
    return float(ts) if isinstance(ts, int | float) else 0.0, list(events)


def event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    """(type, fields) of one event, whether a map with ``type`` or an array led by its tag."""
    if isinstance(event, dict):
        kind = event.get("type")
        if not isinstance(kind, str):
            raise MalformedBatch("event map without a string 'type'")
        return kind, event
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        kind = event[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        return kind, dict(zip(names, event[1:], strict=False))
    raise MalformedBatch(f"event is a {type(event).__name__}")


def block_id(value: Any) -> Hashable:
    """A block hash as a key the index can hold: msgpack reads an array hash as a list, which
    is not hashable."""
    return tuple(value) if isinstance(value, list) else value
