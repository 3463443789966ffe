"""The fetcher over respx-mocked HTTP: limits, redirects, address checks, timeouts, caching."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import respx

from multimodal.errors import ImageRefused
from multimodal.fetch import ImageFetcher
from tests.multimodal.conftest import MakePreparer

URL = "http://images.example.com/cat.png"
BODY = b"\x89PNG not really, the fetcher does not care"


def fetcher(make_preparer: MakePreparer, **config: object) -> ImageFetcher:
    return make_preparer(**config).fetcher


async def refused(fetch: ImageFetcher, url: str = URL) -> str:
    with pytest.raises(ImageRefused) as caught:
        await fetch.fetch(url)
    return caught.value.reason


@respx.mock
async def test_fetches_the_body(make_preparer: MakePreparer) -> None:
    route = respx.get(URL).respond(200, content=BODY)
    fetch = fetcher(make_preparer)
    assert await fetch.fetch(URL) == BODY
    sent = route.calls.last.request
    assert sent.headers["accept-encoding"] == "identity"
    assert sent.headers["user-agent"].startswith("rankgate")


@respx.mock
async def test_too_big_by_content_length(make_preparer: MakePreparer) -> None:
    respx.get(URL).respond(200, content=b"x" * 2000)
    reason = await refused(fetcher(make_preparer, max_image_bytes=1000))
    assert reason == f"{URL} is 2000 bytes, over the limit of 1000 bytes"


@respx.mock
async def test_too_big_while_streaming_without_content_length(
    make_preparer: MakePreparer,
) -> None:
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        while True:
            sent += 256
            yield b"y" * 256

    respx.get(URL).mock(return_value=httpx.Response(200, content=endless()))
    reason = await refused(fetcher(make_preparer, max_image_bytes=1000))
    assert reason == f"{URL} is over the limit of 1000 bytes"
    assert sent <= 1280


@respx.mock
async def test_http_errors_are_reported(make_preparer: MakePreparer) -> None:
    respx.get(URL).respond(404)
    assert await refused(fetcher(make_preparer)) == f"fetching {URL} returned HTTP 404"


@respx.mock
async def test_redirects_are_followed_and_each_hop_checked(make_preparer: MakePreparer) -> None:
    respx.get(URL).respond(302, headers={"location": "/moved.png"})
    respx.get("http://images.example.com/moved.png").respond(
        301, headers={"location": "https://cdn.example.com/final.png"}
    )
    respx.get("https://cdn.example.com/final.png").respond(200, content=BODY)
    assert await fetcher(make_preparer).fetch(URL) == BODY


@pytest.mark.parametrize(
    ("location", "why"),
    [
        ("http://127.0.0.1:8080/x.png", "127.0.0.1, a loopback address"),
        ("http://169.254.169.254/latest/meta-data", "169.254.169.254, a link-local address"),
        ("http://intranet.example.com/x.png", "intranet.example.com resolves to 10.1.2.3"),
        ("file:///etc/passwd", "only http(s) URLs with a host"),
    ],
)
@respx.mock
async def test_redirect_to_a_private_address_is_refused(
    make_preparer: MakePreparer, location: str, why: str
) -> None:
    respx.get(URL).respond(302, headers={"location": location})
    final = respx.route(host__in=("127.0.0.1", "169.254.169.254", "intranet.example.com"))
    final.respond(200, content=BODY)
    reason = await refused(fetcher(make_preparer))
    assert why in reason
    assert not final.called


@respx.mock
async def test_private_address_is_refused_before_any_request(make_preparer: MakePreparer) -> None:
    route = respx.route().respond(200, content=BODY)
    fetch = fetcher(make_preparer)
    for url in ("http://10.0.0.1/a.png", "http://metadata.example.com/", "http://[::1]/a.png"):
        assert "fetching it is not allowed" in await refused(fetch, url)
    assert not route.called


@respx.mock
async def test_too_many_redirects(make_preparer: MakePreparer) -> None:
    respx.get(URL).respond(302, headers={"location": URL})
    reason = await refused(fetcher(make_preparer, max_redirects=2))
    assert reason == f"fetching {URL} took more than 2 redirects"


@respx.mock
async def test_read_timeout(make_preparer: MakePreparer) -> None:
    respx.get(URL).mock(side_effect=httpx.ReadTimeout("slow"))
    assert await refused(fetcher(make_preparer)) == f"fetching {URL} timed out while reading"


@respx.mock
async def test_connect_timeout(make_preparer: MakePreparer) -> None:
    respx.get(URL).mock(side_effect=httpx.ConnectTimeout("slow"))
    assert await refused(fetcher(make_preparer)) == f"fetching {URL} timed out while connecting"


@respx.mock
async def test_total_deadline_covers_a_slow_body(make_preparer: MakePreparer) -> None:
    async def trickle() -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.05)
            yield b"z"

    respx.get(URL).mock(return_value=httpx.Response(200, content=trickle()))
    fetch = fetcher(make_preparer, total_timeout=0.3)
    started = asyncio.get_running_loop().time()
    assert await refused(fetch) == f"fetching {URL} timed out after 0.3s"
    assert asyncio.get_running_loop().time() - started < 2


@respx.mock
async def test_fresh_responses_come_from_the_cache(make_preparer: MakePreparer) -> None:
    route = respx.get(URL).respond(200, content=BODY, headers={"cache-control": "max-age=300"})
    fetch = fetcher(make_preparer)
    assert await fetch.fetch(URL) == BODY
    assert await fetch.fetch(URL) == BODY
    assert (route.call_count, fetch.fetched, fetch.cache_hits) == (1, 1, 1)


@respx.mock
async def test_no_store_is_fetched_every_time(make_preparer: MakePreparer) -> None:
    route = respx.get(URL).respond(200, content=BODY, headers={"cache-control": "no-store"})
    fetch = fetcher(make_preparer)
    await fetch.fetch(URL)
    await fetch.fetch(URL)
    assert route.call_count == 2


@respx.mock
async def test_stale_entries_are_revalidated_with_their_etag(make_preparer: MakePreparer) -> None:
    def serve(request: httpx.Request) -> httpx.Response:
        if request.headers.get("if-none-match") == '"v1"':
            return httpx.Response(304, headers={"etag": '"v1"', "cache-control": "no-cache"})
        return httpx.Response(
            200, content=BODY, headers={"etag": '"v1"', "cache-control": "no-cache"}
        )

    route = respx.get(URL).mock(side_effect=serve)
    fetch = fetcher(make_preparer)
    assert await fetch.fetch(URL) == BODY
    assert await fetch.fetch(URL) == BODY
    assert (route.call_count, fetch.fetched, fetch.revalidated) == (2, 1, 1)
    assert route.calls.last.request.headers["if-none-match"] == '"v1"'


@respx.mock
async def test_the_cache_is_bounded_in_bytes(make_preparer: MakePreparer) -> None:
    headers = {"cache-control": "max-age=300"}
    for name in "abc":
        respx.get(f"http://images.example.com/{name}").respond(
            200, content=name.encode() * 400, headers=headers
        )
    fetch = fetcher(make_preparer, fetch_cache_bytes=1000)
    for name in "abc":
        await fetch.fetch(f"http://images.example.com/{name}")
    assert (len(fetch.cache), fetch.cache.total_bytes) == (2, 800)


async def test_dns_rebinding_after_the_check_is_refused_at_connect(
    make_preparer: MakePreparer,
) -> None:
    answers = iter([["93.184.215.14"], ["127.0.0.1"]])

    async def rebinding(host: str, port: int) -> list[str]:
        return next(answers)

    fetch = make_preparer(resolver=rebinding).fetcher
    reason = await refused(fetch, "http://rebind.example.com:9/x.png")
    assert reason == (
        "host rebind.example.com resolves to 127.0.0.1, a loopback address; "
        "fetching it is not allowed"
    )
