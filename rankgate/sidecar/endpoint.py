"""Parsing the one vLLM gRPC endpoint the gateway talks to.

Operators write endpoints in several styles (``host:port``, ``grpc://``, ``http://`` and the TLS
forms ``grpcs://``/``https://``). Anything that would be silently ignored by a gRPC target, such
as user-info, a path or a query, is rejected so a typo never turns into a different server.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

_SCHEMES: dict[str, tuple[bool, int | None]] = {
    # scheme: (tls, default port)
    "grpc": (False, None),
    "http": (False, 80),
    "grpcs": (True, 443),
    "https": (True, 443),
}


class EndpointError(ValueError):
    """The endpoint string cannot name a gRPC server."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    tls: bool

    @property
    def target(self) -> str:
        """The gRPC target string (IPv6 literals bracketed)."""
        return f"{self.url_host}:{self.port}"

    @property
    def url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host


def parse_endpoint(text: str) -> Endpoint:
    raw = text.strip()
    if not raw:
        raise EndpointError("endpoint is empty")
    tls = False
    default_port: int | None = None
    rest = raw
    if "://" in raw:
        scheme, rest = raw.split("://", 1)
        scheme = scheme.lower()
        if scheme not in _SCHEMES:
            allowed = ", ".join(f"{name}://" for name in _SCHEMES)
            raise EndpointError(f"endpoint {text!r}: unsupported scheme {scheme!r} (use {allowed})")
        tls, default_port = _SCHEMES[scheme]
        if rest.endswith("/"):
            rest = rest[:-1]
    for mark, what in (("@", "user-info"), ("/", "a path"), ("?", "a query"), ("#", "a fragment")):
        if mark in rest:
            raise EndpointError(f"endpoint {text!r} must not contain {what}; give host:port only")
    host, port_text = _split_host_port(rest, text)
    if port_text is None:
        if default_port is None:
            raise EndpointError(f"endpoint {text!r} has no port")
        port = default_port
    else:
        if not (port_text.isascii() and port_text.isdigit()):
            raise EndpointError(f"endpoint {text!r}: port {port_text!r} is not a number")
        port = int(port_text)
        if not 0 < port < 65536:
            raise EndpointError(f"endpoint {text!r}: port {port} is out of range")
    return Endpoint(host=host, port=port, tls=tls)


def _split_host_port(rest: str, original: str) -> tuple[str, str | None]:
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise EndpointError(f"endpoint {original!r}: unclosed '[' in IPv6 address")
        host = rest[1:close]
        tail = rest[close + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise EndpointError(f"endpoint {original!r}: {host!r} is not an IPv6 address") from None
        if not tail:
            return host, None
        if not tail.startswith(":"):
            raise EndpointError(f"endpoint {original!r}: unexpected text after ']'")
        return host, tail[1:]
    if rest.count(":") > 1:
        raise EndpointError(f"endpoint {original!r}: write IPv6 addresses in brackets, [::1]:port")
    host, sep, port = rest.partition(":")
    if not host:
        raise EndpointError(f"endpoint {original!r} has no host")
    return host, (port if sep else None)
