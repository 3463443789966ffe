"""The KV index saved when the gateway stops and loaded when it starts beside the same engine.

A gateway restarted alone (a rolling update of its container) would otherwise route blind
until new KV events rebuilt its view: every conversation's next turn could land on a rank
that does not hold it. Saved with the index is each rank's next expected event sequence
number, so the intake resumes exactly there: what the engine published meanwhile is a gap
that vLLM's replay buffer fills, and if it cannot, the rank is purged as for any unfillable
gap. The file is used only for the same engine process (its model, instance id, block size
and ranks) and only while younger than ``max_age``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import msgspec

from rankgate.sidecar.routing.index import TIERS, EventIndex

log = logging.getLogger(__name__)

VERSION = 1


class _Slot(msgspec.Struct, array_like=True, gc=False):
    slot: int
    expected: int | None
    # Per tier: [vLLM block hash, our key] pairs, oldest first.
    tiers: list[list[tuple[Any, int]]]


class _Saved(msgspec.Struct, gc=False):
    version: int
    identity: str
    saved_at: float
    slots: list[_Slot]


def save(
    path: str, identity: str, index: EventIndex, positions: dict[int, int], now: float
) -> None:
    """Write the index atomically (a crash mid-write leaves the previous file)."""
    slots = [
        _Slot(slot, positions.get(slot), [index.entries(slot, tier) for tier in TIERS])
        for slot in range(index.slots)
    ]
    data = msgspec.msgpack.encode(_Saved(VERSION, identity, now, slots))
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, target)
    blocks = sum(len(tier) for slot in slots for tier in slot.tiers)
    log.info("saved the KV index (%d blocks) to %s", blocks, path)


def load(
    path: str, identity: str, index: EventIndex, max_age: float, now: float
) -> dict[int, int] | None:
    """Fill ``index`` from the file and return where each slot's events resume; None (the
    index untouched) when there is no file or it is not for this engine or too old."""
    target = Path(path)
    try:
        data = target.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        log.warning("cannot read the saved KV index %s: %s", path, error)
        return None
    try:
        saved = msgspec.msgpack.decode(data, type=_Saved)
    except msgspec.DecodeError as error:
        log.warning("ignoring the saved KV index %s: %s", path, error)
        return None
    why = _unusable(saved, identity, index, max_age, now)
    if why is not None:
        log.info("not loading the saved KV index %s: %s", path, why)
        return None
    positions: dict[int, int] = {}
    blocks = 0
    for entry in saved.slots:
        for tier, pairs in zip(TIERS, entry.tiers, strict=False):
            for block_hash, key in pairs:
                index.store(entry.slot, tier, _hashable(block_hash), key)
            blocks += len(pairs)
        if entry.expected is not None:
            positions[entry.slot] = entry.expected
    log.info(
        "loaded the KV index saved %.0f s ago (%d blocks) from %s",
        now - saved.saved_at,
        blocks,
        path,
    )
    return positions


def _unusable(
    saved: _Saved, identity: str, index: EventIndex, max_age: float, now: float
) -> str | None:
    if saved.version != VERSION:
        return f"format {saved.version}, not {VERSION}"
    if saved.identity != identity:
        return "saved for another engine"
    age = now - saved.saved_at
    if not 0 <= age <= max_age:
        return f"saved {age:.0f} s ago, more than {max_age:.0f} s"
    if any(not 0 <= entry.slot < index.slots for entry in saved.slots):
        return "saved for other ranks"
    return None


def _hashable(value: Any) -> Hashable:
    """vLLM's block hash as the intake keys it (lists, which msgpack makes of tuples, back)."""
    if isinstance(value, list):
        return tuple(_hashable(item) for item in value)
    hashable: Hashable = value
    return hashable
