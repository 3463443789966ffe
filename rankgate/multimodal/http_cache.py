"""A shared HTTP cache of fetched image bodies, bounded in bytes, honouring caching headers.

The gateway is a shared cache in RFC 9111 terms: it stores nothing marked ``no-store`` or
``private`` (nor ``Vary: *``), takes freshness from ``s-maxage``, ``max-age`` (minus
``Age``) or ``Expires`` (against ``Date``), falls back to the usual heuristic of a tenth of
the time since ``Last-Modified`` (at most a day), and keeps stale or ``no-cache`` bodies only
when it can revalidate them with ``ETag`` / ``Last-Modified``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime

import msgspec

from rankgate.multimodal.lru import BoundedLRU

_HEURISTIC_FRACTION = 0.1
_HEURISTIC_CAP_S = 86400.0


class CachedBody(msgspec.Struct, frozen=True):
    data: bytes
    fresh_until: float
    etag: str | None = None
    last_modified: str | None = None

    @property
    def revalidatable(self) -> bool:
        return self.etag is not None or self.last_modified is not None

    def conditional_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.etag is not None:
            headers["if-none-match"] = self.etag
        if self.last_modified is not None:
            headers["if-modified-since"] = self.last_modified
        return headers


def _directives(value: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in value.split(","):
        name, _, arg = part.strip().partition("=")
        if name:
            found[name.lower()] = arg.strip().strip('"')
    return found


def _seconds(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return max(0.0, float(int(text)))
    except ValueError:
        return None


def _http_date(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def lifetime(headers: Mapping[str, str], wall_now: float) -> float | None:
    """Seconds the response stays fresh from now; None when a shared cache must not store it."""
    cc = _directives(headers.get("cache-control", ""))
    if "no-store" in cc or "private" in cc or headers.get("vary", "").strip() == "*":
        return None
    if "no-cache" in cc:
        return 0.0
    age = _seconds(headers.get("age")) or 0.0
    for name in ("s-maxage", "max-age"):
        if name in cc:
            max_age = _seconds(cc[name])
            return 0.0 if max_age is None else max(0.0, max_age - age)
    date = _http_date(headers.get("date")) or wall_now
    if "expires" in headers:
        expires = _http_date(headers.get("expires"))
        return 0.0 if expires is None else max(0.0, expires - date - age)
    modified = _http_date(headers.get("last-modified"))
    if modified is not None and modified < date:
        return max(0.0, min((date - modified) * _HEURISTIC_FRACTION, _HEURISTIC_CAP_S) - age)
    return 0.0


class FetchCache:
    """URL → body, LRU-evicted to stay within ``capacity_bytes``."""

    def __init__(
        self,
        capacity_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._entries: BoundedLRU[str, CachedBody] = BoundedLRU(
            capacity_bytes, cost=lambda body: len(body.data)
        )
        self._clock = clock
        self._wall_clock = wall_clock

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return self._entries.total_cost

    def lookup(self, url: str) -> CachedBody | None:
        return self._entries.get(url)

    def is_fresh(self, body: CachedBody) -> bool:
        return self._clock() < body.fresh_until

    def store(self, url: str, headers: Mapping[str, str], data: bytes) -> None:
        seconds = lifetime(headers, self._wall_clock())
        etag = headers.get("etag")
        modified = headers.get("last-modified")
        if seconds is None or (seconds <= 0 and etag is None and modified is None):
            self._entries.pop(url)
            return
        self._entries.put(
            url,
            CachedBody(
                data=data, fresh_until=self._clock() + seconds, etag=etag, last_modified=modified
            ),
        )

    def refresh(self, url: str, stale: CachedBody, headers: Mapping[str, str]) -> None:
        """Apply a 304's headers to a revalidated body (RFC 9111 section 4.3.4)."""
        merged = {
            "etag": stale.etag or "",
            "last-modified": stale.last_modified or "",
        }
        merged = {k: v for k, v in merged.items() if v}
        merged.update({k.lower(): v for k, v in headers.items()})
        self.store(url, merged, stale.data)
