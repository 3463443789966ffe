"""httpx's client side over an httpcore connection pool on :class:`GuardedBackend`.

httpx's own transport builds its pool itself and takes no network backend, so this one is the
small transport httpx documents for custom ones (``httpx.AsyncBaseTransport``) over httpcore's
public pool: every connection it opens goes through the address policy. httpcore's errors are
raised as the httpx errors they stand for, so callers catch httpx's types alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpcore
import httpx

from rankgate.multimodal.addresses import AddressPolicy, GuardedBackend

# Most specific first: the first match is the error raised.
_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


def as_httpx_error(error: Exception) -> Exception:
    """The httpx error an httpcore error stands for; any other error as it is."""
    for core, mapped in _ERRORS:
        if isinstance(error, core):
            return mapped(str(error))
    return error


class GuardedTransport(httpx.AsyncBaseTransport):
    def __init__(self, policy: AddressPolicy, limits: httpx.Limits) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=GuardedBackend(policy),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        url = request.url
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            response = await self._pool.handle_async_request(core)
        except Exception as exc:
            raise as_httpx_error(exc) from exc
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Body(response),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: httpcore.Response) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_stream():
                yield chunk
        except Exception as exc:
            raise as_httpx_error(exc) from exc

    async def aclose(self) -> None:
        await self._response.aclose()
