"""Which network addresses the image fetcher may reach, checked on resolved IPs.

A host name is resolved and every address it resolves to must be public, or inside an
operator's allow-list: loopback, private, shared (CGNAT), link-local (cloud metadata at
169.254.169.254), multicast, reserved and unspecified addresses are refused, as are IPv6
forms that embed such an IPv4 address (mapped, 6to4, Teredo, NAT64), and the IPv4-compatible
(``::/96``) and site-local (``fec0::/10``) ranges that ``ipaddress`` calls global. The check
runs before each request and each redirect hop for a clear error, and again in
:class:`GuardedBackend` at connect time on the very addresses the socket connects to, so DNS
rebinding between the check and the connection gains nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import typing
from collections.abc import Awaitable, Callable, Iterable, Sequence

import httpcore

from rankgate.multimodal.errors import MediaRefused

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# RFC 8215's local-use NAT64 prefix: the last 32 bits are an IPv4 address too.
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")
# IPv6 ranges that ``ipaddress`` counts as global but that are not: IPv4-compatible
# addresses (deprecated by RFC 4291; ``::`` and ``::1`` sit in it too), and site-local
# addresses (deprecated by RFC 3879, still routed inside some sites).
_NOT_GLOBAL_V6: tuple[tuple[ipaddress.IPv6Network, str], ...] = (
    (ipaddress.IPv6Network("::/96"), "IPv4-compatible"),
    (ipaddress.IPv6Network("fec0::/10"), "site-local"),
)


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """All addresses ``host`` resolves to, through the loop's non-blocking getaddrinfo."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64 or address in _LOCAL_NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _why_blocked(address: IPAddress) -> str | None:
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None:
            return _why_blocked(inner)
        if address.is_loopback:
            return "loopback"
        if address.is_unspecified:
            return "unspecified"
        for network, kind in _NOT_GLOBAL_V6:
            if address in network:
                return kind
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.is_unspecified:
        return "unspecified"
    if address.is_private:
        return "private"
    if not address.is_global:
        return "not globally routable"
    return None


class AddressPolicy:
    """Resolves hosts and refuses non-public addresses unless an allowed network holds them."""

    def __init__(self, allowed_networks: Iterable[str] = (), resolver: Resolver | None = None):
        self._allowed: tuple[IPNetwork, ...] = tuple(
            ipaddress.ip_network(net, strict=False) for net in allowed_networks
        )
        self._resolver = resolver or system_resolver

    def check_ip(self, host: str, address: IPAddress) -> None:
        if any(address.version == net.version and address in net for net in self._allowed):
            return
        reason = _why_blocked(address)
        if reason is not None:
            shown = f"host {host} resolves to {address}" if host != str(address) else str(address)
            if isinstance(address, ipaddress.IPv6Address) and _embedded_ipv4(address) is not None:
                shown += f" (which embeds {_embedded_ipv4(address)})"
            article = "an" if reason[0] in "aeiouIU" else "a"
            raise MediaRefused(f"{shown}, {article} {reason} address; fetching it is not allowed")

    async def resolve_allowed(self, host: str, port: int) -> tuple[str, ...]:
        """The addresses to connect to; refuses when any of them is not allowed."""
        bare = host.strip("[]")
        try:
            literal: IPAddress | None = ipaddress.ip_address(bare.split("%", 1)[0])
        except ValueError:
            literal = None
        if literal is not None:
            self.check_ip(bare, literal)
            return (bare,)
        try:
            found = await self._resolver(bare, port)
        except OSError as exc:
            raise MediaRefused(f"cannot resolve host {bare}: {exc}") from None
        if not found:
            raise MediaRefused(f"host {bare} resolves to no address")
        for text in found:
            self.check_ip(bare, ipaddress.ip_address(text.split("%", 1)[0]))
        return tuple(dict.fromkeys(found))


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses the policy allows.

    httpcore hands TLS the original host name for SNI and certificate checks, so connecting
    to the resolved address here keeps HTTPS intact.
    """

    def __init__(self, policy: AddressPolicy, inner: httpcore.AsyncNetworkBackend | None = None):
        self._policy = policy
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await self._policy.resolve_allowed(host, port)
        options = list(socket_options) if socket_options is not None else None
        failure: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address, options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise MediaRefused("unix sockets are not fetched")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)
