"""Fetching media over HTTP(S) with one shared client, hard limits and address checks.

Redirects are followed by hand so that every hop's scheme and addresses are checked; the body
is read in chunks, as sent (a compressed body is refused, never inflated), and abandoned the
moment it passes the size limit; one deadline covers the
whole fetch, redirects included, on top of httpx's connect and read timeouts. Environment
proxies are ignored, as a proxy would make the address checks meaningless.
"""

from __future__ import annotations

import asyncio

import httpx

from rankgate.multimodal.addresses import AddressPolicy
from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.http_cache import FetchCache
from rankgate.multimodal.transport import GuardedTransport
from rankgate.multimodal.types import MediaConfig

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SHOWN_URL_CHARS = 120


def shown(url: str) -> str:
    text = ascii(url)[1:-1]
    return text if len(text) <= _SHOWN_URL_CHARS else text[: _SHOWN_URL_CHARS - 3] + "..."


def parse_url(url: str, base: httpx.URL | None = None) -> httpx.URL:
    """``url`` (relative to ``base``, for a redirect's Location) as an http(s) URL with a host
    and a valid port, or an :class:`MediaRefused` saying why not.

    httpx and the IDNA codec refuse malformed hosts, ports and IPv4/IPv6 literals with
    several exception types (``InvalidURL``, ``UnicodeError``, ``ValueError``); all of them are
    a client's mistake here.
    """
    try:
        target = base.join(url) if base is not None else httpx.URL(url)
        scheme, host, port = target.scheme, target.host, target.port
    except (httpx.InvalidURL, ValueError) as exc:
        raise MediaRefused(f"cannot fetch {shown(url)}: {exc}") from None
    if scheme not in ("http", "https") or not host:
        raise MediaRefused(f"cannot fetch {shown(url)}: only http(s) URLs with a host")
    if port is not None and not 0 < port < 65536:
        raise MediaRefused(f"cannot fetch {shown(url)}: port {port} is out of range")
    return target


class ImageFetcher:
    """Downloads media bodies; every failure is a :class:`MediaRefused` naming the URL."""

    def __init__(self, config: MediaConfig, policy: AddressPolicy) -> None:
        self._config = config
        self._policy = policy
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_connections,
        )
        self._client = httpx.AsyncClient(
            transport=GuardedTransport(policy, limits),
            timeout=httpx.Timeout(
                connect=config.connect_timeout,
                read=config.read_timeout,
                write=config.read_timeout,
                pool=config.connect_timeout,
            ),
            headers={
                "user-agent": config.user_agent,
                "accept": "image/*, audio/*, video/*",
                "accept-encoding": "identity",
            },
            follow_redirects=False,
            trust_env=False,
        )
        self.cache = FetchCache(config.fetch_cache_bytes)
        self.fetched = 0
        self.cache_hits = 0
        self.revalidated = 0

    async def fetch(self, url: str, limit: int | None = None) -> bytes:
        """The body at ``url``, at most ``limit`` bytes (the image limit by default)."""
        total = self._config.total_timeout
        limit = self._config.max_image_bytes if limit is None else limit
        try:
            async with asyncio.timeout(total):
                body = await self._follow(url, limit)
        except TimeoutError:
            raise MediaRefused(f"fetching {shown(url)} timed out after {total:g}s") from None
        except httpx.TimeoutException as exc:
            connecting = isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
            phase = "connecting" if connecting else "reading"
            raise MediaRefused(f"fetching {shown(url)} timed out while {phase}") from None
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
            detail = str(exc) or type(exc).__name__
            raise MediaRefused(f"fetching {shown(url)} failed: {detail}") from None
        if len(body) > limit:
            # A body cached for a kind with a larger limit.
            raise MediaRefused(
                f"{shown(url)} is {len(body)} bytes, over the limit of {limit} bytes"
            )
        return body

    async def _follow(self, url: str, limit: int) -> bytes:
        target = parse_url(url)
        for _hop in range(self._config.max_redirects + 1):
            current = str(target)
            cached = self.cache.lookup(current)
            if cached is not None and self.cache.is_fresh(cached):
                self.cache_hits += 1
                return cached.data
            port = target.port or (443 if target.scheme == "https" else 80)
            await self._policy.resolve_allowed(target.host, port)
            headers = cached.conditional_headers() if cached is not None else None
            async with self._client.stream("GET", target, headers=headers) as response:
                if response.status_code in _REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise MediaRefused(f"redirect without a Location from {shown(current)}")
                    target = parse_url(location, base=target)
                    continue
                if response.status_code == 304 and cached is not None:
                    self.revalidated += 1
                    self.cache.refresh(current, cached, response.headers)
                    return cached.data
                if response.status_code != 200:
                    raise MediaRefused(
                        f"fetching {shown(current)} returned HTTP {response.status_code}"
                    )
                body = await self._read_bounded(response, current, limit)
            self.fetched += 1
            self.cache.store(current, response.headers, body)
            return body
        raise MediaRefused(
            f"fetching {shown(url)} took more than {self._config.max_redirects} redirects"
        )

    async def _read_bounded(self, response: httpx.Response, url: str, limit: int) -> bytes:
        """The body as sent, never decompressed: the fetcher asks for ``identity`` and refuses
        any other content coding, so a few hundred bytes cannot inflate to gigabytes."""
        codings = [
            part.strip().lower()
            for part in response.headers.get("content-encoding", "").split(",")
            if part.strip()
        ]
        if any(coding != "identity" for coding in codings):
            raise MediaRefused(
                f"{shown(url)} was sent with Content-Encoding "
                f"{response.headers['content-encoding']!r}; media must be sent uncompressed"
            )
        declared = response.headers.get("content-length")
        if (
            declared is not None
            and declared.isascii()
            and declared.isdigit()
            and int(declared) > limit
        ):
            raise MediaRefused(
                f"{shown(url)} is {int(declared)} bytes, over the limit of {limit} bytes"
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > limit:
                raise MediaRefused(f"{shown(url)} is over the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        await self._client.aclose()
