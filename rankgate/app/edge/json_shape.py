"""The shape of a JSON text, measured without parsing it: nesting depth, containers, items.

A parser's cost and its recursion both grow with the text's structure, not its byte size: a
megabyte of ``[[],[],...]`` builds half a million lists, and a deep one overflows whatever walks
it later (a template, protobuf, a recursive converter). The shape is what the limits in
:mod:`rankgate.app.edge.limits` are checked against before the body is decoded.

The scan is one pass, like the first stage of simdjson, done with numpy's vector operations
over chunks of the text: find the quotes that no odd run of backslashes escapes, mark what
lies inside strings by a running parity of those quotes, and take the running sum of the
brackets outside them. Nothing backtracks; the work is a constant number of vector operations
per byte whatever the text holds, and numpy runs them with the GIL released, so a large text
can be scanned on a worker thread while the event loop serves everyone else.

The text need not be valid JSON: for an invalid one the shape is only what the same rules
give (the parser will refuse the text anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_QUOTE = 0x22
_BACKSLASH = 0x5C
_COMMA = 0x2C
_COLON = 0x3A
_OPEN = (0x5B, 0x7B)
_CLOSE = (0x5D, 0x7D)
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class JsonShape:
    # The deepest nesting of arrays and objects outside strings (a scalar text has 0).
    depth: int
    # Arrays and objects.
    containers: int
    # Array elements and object members after the first of each (commas), object members
    # (colons) and backslashes: what a parser does per item, outside the bytes it copies.
    items: int


def could_exceed(text: bytes, depth: int, containers: int, items: int) -> bool:
    """Whether the shape of ``text`` may pass any of the limits (False: it certainly does not).

    Counting bytes is a C-speed scan; most bodies have fewer brackets than the depth limit
    and fewer bytes than the item limit, and need no shape at all.
    """
    brackets = text.count(b"[") + text.count(b"{")
    return brackets > min(depth, containers) or len(text) > items


def json_shape(
    text: bytes, *, depth_limit: int = 0, container_limit: int = 0, item_limit: int = 0
) -> JsonShape:
    """The shape of ``text``; with limits (0: none), the scan stops at the first chunk that
    passes one of them, and the shape is then only as far as it got (already over a limit)."""
    data = np.frombuffer(text, dtype=np.uint8)
    inside = False
    run = 0
    depth = deepest = containers = items = 0
    for start in range(0, len(data), _CHUNK):
        chunk = data[start : start + _CHUNK]
        has_backslash = run > 0 or text.find(b"\\", start, start + len(chunk)) >= 0
        quotes = np.flatnonzero(chunk == _QUOTE)
        if has_backslash:
            backslashes = chunk == _BACKSLASH
            items += int(np.count_nonzero(backslashes))
            # Only a quote right after a backslash can be escaped.
            follows = backslashes[quotes - 1]
            if quotes.size and quotes[0] == 0:
                follows[0] = run > 0
            candidates = np.flatnonzero(follows)
            if candidates.size:
                plain = np.flatnonzero(~backslashes)
                escaped = candidates[_escaped(quotes[candidates], plain, run)]
                if escaped.size:
                    keep = np.ones(quotes.size, dtype=bool)
                    keep[escaped] = False
                    quotes = quotes[keep]
            plain_tail = ~backslashes[::-1]
            if plain_tail.any():
                run = int(np.argmax(plain_tail))
            else:
                run += len(chunk)
        if not quotes.size:
            if inside:
                continue
            outside = None
        else:
            toggles = np.zeros(len(chunk), dtype=np.uint8)
            toggles[quotes] = 1
            parity = np.bitwise_xor.accumulate(toggles)
            # A position is outside strings when an even number of real quotes lies at or
            # before it (counting the ones carried in): its parity equals the carried-in state.
            outside = parity == (1 if inside else 0)
            inside = bool(parity[-1]) != inside
        opens = (chunk == _OPEN[0]) | (chunk == _OPEN[1])
        closes = (chunk == _CLOSE[0]) | (chunk == _CLOSE[1])
        separators = (chunk == _COMMA) | (chunk == _COLON)
        if outside is not None:
            opens &= outside
            closes &= outside
            separators &= outside
        items += int(np.count_nonzero(separators))
        brackets = np.flatnonzero(opens | closes)
        if brackets.size:
            steps = opens[brackets].astype(np.int32) * 2 - 1
            profile = np.cumsum(steps)
            deepest = max(deepest, depth + int(profile.max()))
            depth += int(profile[-1])
            containers += int(np.count_nonzero(opens))
        if (
            (depth_limit and deepest > depth_limit)
            or (container_limit and containers > container_limit)
            or (item_limit and items > item_limit)
        ):
            break
    return JsonShape(depth=deepest, containers=containers, items=items)


def _escaped(quotes: np.ndarray, plain: np.ndarray, run: int) -> np.ndarray:
    """Which of ``quotes`` follow an odd run of backslashes (``plain``: the chunk's indices
    that hold no backslash; ``run``: backslashes ending the chunk before)."""
    # The last non-backslash before each quote; a quote itself is in ``plain``.
    before = np.searchsorted(plain, quotes) - 1
    last = np.where(before >= 0, plain[np.maximum(before, 0)], -1 - run)
    escaped: np.ndarray = ((quotes - 1 - last) & 1).astype(bool)
    return escaped
