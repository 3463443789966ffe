"""The fetcher over respx-mocked HTTP: limits, redirects, address checks, timeouts, caching."""

from __future__ import annotations

import asyncio
import gzip
import threading
import zlib
from collections.abc import AsyncIterator, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import brotli  # type: ignore[import-untyped]
import httpx
import pytest
import respx

from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.fetch import ImageFetcher
from tests.multimodal.conftest import MakePreparer

URL = "http://images.example.com/cat.png"
BODY = b"\x89PNG not really, the fetcher does not care"


def fetcher(make_preparer: MakePreparer, **config: object) -> ImageFetcher:
    return make_preparer(**config).fetcher


async def refused(fetch: ImageFetcher, url: str = URL) -> str:
    with pytest.raises(MediaRefused) as caught:
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


class EncodedServer:
    """A loopback server answering every GET with one body and a Content-Encoding header."""

    def __init__(self, body: bytes, encoding: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "image/png")
                self.send_header("content-encoding", encoding)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/bomb.png"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [
        ("gzip", lambda raw: gzip.compress(raw)),
        ("gzip, gzip", lambda raw: gzip.compress(gzip.compress(raw))),
        ("deflate", zlib.compress),
        ("br", lambda raw: brotli.compress(raw, quality=5)),
    ],
)
async def test_compressed_bodies_are_refused_never_inflated(
    encoding: str, compress: Callable[[bytes], bytes]
) -> None:
    # 256 MiB of zeros in a few hundred KB (or bytes); it must not be inflated to find out.
    server = EncodedServer(compress(b"\0" * (256 << 20)), encoding)
    preparer = MediaPreparer(MediaConfig(allowed_networks=("127.0.0.0/8",)))
    try:
        reason = await refused(preparer.fetcher, server.url)
    finally:
        await preparer.aclose()
        server.close()
    assert f"Content-Encoding {encoding!r}" in reason
    assert "uncompressed" in reason


@respx.mock
async def test_identity_encoding_is_read_as_sent(make_preparer: MakePreparer) -> None:
    respx.get(URL).respond(200, content=BODY, headers={"content-encoding": "identity"})
    assert await fetcher(make_preparer).fetch(URL) == BODY


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1", "http://[1::2::3]/a", "http://[v1.x]/", "http://\uff11\uff12\uff17.0.0.1/",
        "http://0177.0.0.01/a.png", "http://\u2488/", "http://xn--/", "http://a..b/", "http://./",
        "http://1.2.3.4:99999/", "http://\x00/", "http://" + "a" * 300 + ".com/", "http://\ud800/",
        "ftp://example.com/a.png", "http:///a",
    ],
)  # fmt: skip
async def test_urls_httpx_or_idna_refuse_are_refusals(
    make_preparer: MakePreparer, url: str
) -> None:
    assert await refused(fetcher(make_preparer), url)


@respx.mock
async def test_a_redirect_to_a_malformed_location_is_a_refusal(make_preparer: MakePreparer) -> None:
    respx.get(URL).respond(302, headers={"location": "http://[::1"})
    assert "Invalid" in await refused(fetcher(make_preparer))
