"""Fetching images over HTTP(S) with one shared client, hard limits and address checks.

Redirects are followed by hand so that every hop's scheme and addresses are checked; the body
is read in chunks and abandoned the moment it passes the size limit; one deadline covers the
whole fetch, redirects included, on top of httpx's connect and read timeouts. Environment
proxies are ignored, as a proxy would make the address checks meaningless.
"""

from __future__ import annotations

import asyncio

import httpcore
import httpx

from multimodal.addresses import AddressPolicy, GuardedBackend
from multimodal.errors import ImageRefused
from multimodal.http_cache import FetchCache
from multimodal.types import MediaConfig

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SHOWN_URL_CHARS = 120


def shown(url: str) -> str:
    return url if len(url) <= _SHOWN_URL_CHARS else url[: _SHOWN_URL_CHARS - 3] + "..."


class _GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport with its connection pool swapped for one on :class:`GuardedBackend`.

    httpx has no public way to pass httpcore a network backend; rebuilding the pool it made
    is the smallest change that keeps httpx's request mapping and error translation.
    """

    def __init__(self, policy: AddressPolicy, limits: httpx.Limits) -> None:
        ssl_context = httpx.create_ssl_context(trust_env=False)
        super().__init__(verify=ssl_context, limits=limits, trust_env=False, retries=0)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=GuardedBackend(policy),
        )


class ImageFetcher:
    """Downloads image bodies; every failure is an :class:`ImageRefused` naming the URL."""

    def __init__(self, config: MediaConfig, policy: AddressPolicy) -> None:
        self._config = config
        self._policy = policy
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_connections,
        )
        self._client = httpx.AsyncClient(
            transport=_GuardedTransport(policy, limits),
            timeout=httpx.Timeout(
                connect=config.connect_timeout,
                read=config.read_timeout,
                write=config.read_timeout,
                pool=config.connect_timeout,
            ),
            headers={
                "user-agent": config.user_agent,
                "accept": "image/*",
                "accept-encoding": "identity",
            },
            follow_redirects=False,
            trust_env=False,
        )
        self.cache = FetchCache(config.fetch_cache_bytes)
        self.fetched = 0
        self.cache_hits = 0
        self.revalidated = 0

    async def fetch(self, url: str) -> bytes:
        total = self._config.total_timeout
        try:
            async with asyncio.timeout(total):
                return await self._follow(url)
        except TimeoutError:
            raise ImageRefused(f"fetching {shown(url)} timed out after {total:g}s") from None
        except httpx.TimeoutException as exc:
            connecting = isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
            phase = "connecting" if connecting else "reading"
            raise ImageRefused(f"fetching {shown(url)} timed out while {phase}") from None
        except httpx.HTTPError as exc:
            detail = str(exc) or type(exc).__name__
            raise ImageRefused(f"fetching {shown(url)} failed: {detail}") from None

    async def _follow(self, url: str) -> bytes:
        current = url
        for _hop in range(self._config.max_redirects + 1):
            target = httpx.URL(current)
            if target.scheme not in ("http", "https") or not target.host:
                raise ImageRefused(f"cannot fetch {shown(current)}: only http(s) URLs with a host")
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
                        raise ImageRefused(f"redirect without a Location from {shown(current)}")
                    current = str(target.join(location))
                    continue
                if response.status_code == 304 and cached is not None:
                    self.revalidated += 1
                    self.cache.refresh(current, cached, response.headers)
                    return cached.data
                if response.status_code != 200:
                    raise ImageRefused(
                        f"fetching {shown(current)} returned HTTP {response.status_code}"
                    )
                body = await self._read_bounded(response, current)
            self.fetched += 1
            self.cache.store(current, response.headers, body)
            return body
        raise ImageRefused(
            f"fetching {shown(url)} took more than {self._config.max_redirects} redirects"
        )

    async def _read_bounded(self, response: httpx.Response, url: str) -> bytes:
        limit = self._config.max_image_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ImageRefused(
                f"{shown(url)} is {int(declared)} bytes, over the limit of {limit} bytes"
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise ImageRefused(f"{shown(url)} is over the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        await self._client.aclose()
