"""Freshness rules of the fetch cache and its byte bound."""

from __future__ import annotations

from email.utils import formatdate

import pytest

from rankgate.multimodal.http_cache import FetchCache, lifetime

NOW = 1_800_000_000.0


def http_date(offset: float) -> str:
    return formatdate(NOW + offset, usegmt=True)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"cache-control": "max-age=60"}, 60.0),
        ({"cache-control": "public, max-age=60", "age": "15"}, 45.0),
        ({"cache-control": "max-age=60, s-maxage=600"}, 600.0),
        ({"cache-control": "no-cache, max-age=60"}, 0.0),
        ({"cache-control": "no-store"}, None),
        ({"cache-control": "private, max-age=60"}, None),
        ({"cache-control": "max-age=60", "vary": "*"}, None),
        ({"cache-control": "max-age=soon"}, 0.0),
        ({"expires": http_date(120), "date": http_date(0)}, 120.0),
        ({"expires": "0"}, 0.0),
        ({"last-modified": http_date(-1000), "date": http_date(0)}, 100.0),
        ({"last-modified": http_date(-10_000_000), "date": http_date(0)}, 86400.0),
        ({}, 0.0),
    ],
)
def test_lifetime(headers: dict[str, str], expected: float | None) -> None:
    assert lifetime(headers, NOW) == expected


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_fresh_then_stale_then_refreshed_by_a_304() -> None:
    clock = Clock()
    cache = FetchCache(1000, clock=clock, wall_clock=lambda: NOW)
    cache.store("u", {"cache-control": "max-age=10", "etag": '"v1"'}, b"body")
    body = cache.lookup("u")
    assert body is not None
    assert cache.is_fresh(body)
    clock.now += 11
    assert not cache.is_fresh(body)
    assert body.conditional_headers() == {"if-none-match": '"v1"'}
    cache.refresh("u", body, {"cache-control": "max-age=30"})
    renewed = cache.lookup("u")
    assert renewed is not None
    assert cache.is_fresh(renewed)
    assert (renewed.data, renewed.etag) == (b"body", '"v1"')


def test_unstorable_and_unvalidatable_responses_are_dropped() -> None:
    cache = FetchCache(1000, wall_clock=lambda: NOW)
    cache.store("a", {"cache-control": "no-store"}, b"x")
    cache.store("b", {}, b"x")
    cache.store("c", {"cache-control": "no-cache", "last-modified": http_date(-5)}, b"x")
    assert (cache.lookup("a"), cache.lookup("b")) == (None, None)
    kept = cache.lookup("c")
    assert kept is not None
    assert not cache.is_fresh(kept)
    assert kept.revalidatable
    cache.store("c", {"cache-control": "no-store"}, b"y")
    assert cache.lookup("c") is None


def test_bounded_in_bytes() -> None:
    cache = FetchCache(10, wall_clock=lambda: NOW)
    for name in "abc":
        cache.store(name, {"cache-control": "max-age=60"}, b"12345")
    assert (cache.lookup("a"), len(cache), cache.total_bytes) == (None, 2, 10)
