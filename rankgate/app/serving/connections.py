"""What a gateway connection is held to and tells the app: its limits, and its client's state.

:class:`ConnectionLimits` are the bounds every HTTP/1.1 connection is served under (enforced
where the bytes arrive, by :mod:`rankgate.app.serving.http1`): the size of a request's head,
deadlines for its head, its body and an idle keep-alive, and a cap on connections per worker. Each
request's scope carries a :class:`DisconnectNotice`, fired when its client leaves before the
response is complete, and its connection's :class:`PeerWindow`, the receive window the client's TCP
advertises, from which :mod:`rankgate.app.serving.clients` tells a reader that stopped reading.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_U32 = struct.Struct("=I")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    # Bytes of a request's head: request line and headers.
    max_header_bytes: int = 32 << 10
    max_headers: int = 128
    # Seconds for a request's whole head, from connect or from the previous response.
    header_timeout: float = 10.0
    # Seconds for a request's whole body, from the end of its head.
    body_timeout: float = 60.0
    # Seconds an idle keep-alive connection is kept (uvicorn counts whole seconds): longer than
    # the pools of the clients in front (aiohttp 15 s, Go 90 s, curl 118 s, OkHttp 300 s), so a
    # client never reuses a connection just as the gateway closes it. Under the cap, the
    # connection idle longest gives its place to a newcomer, so a long idle costs a socket.
    keepalive_timeout: int = 330
    # Open connections per worker process.
    max_connections: int = 2048

    @property
    def eviction_grace(self) -> float:
        """Seconds a connection without a request in flight is spared from eviction."""
        return min(1.0, self.header_timeout / 4)

    @property
    def reserve(self) -> int:
        """Connections past the cap let in for the health probes while every slot is busy."""
        return max(4, self.max_connections // 64)

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be at least 1024")
        if self.max_headers < 8:
            raise ValueError("max_headers must be at least 8")
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")


# What a connection let in past the cap may ask for.
PROBE_PATHS = frozenset({b"/health", b"/ready"})

# The scope key of a request's DisconnectNotice.
DISCONNECT_NOTICE = "rankgate.disconnect"
# The scope key of the connection's PeerWindow.
PEER_WINDOW = "rankgate.peer_window"
_TCP_INFO_LEN = 232


class PeerWindow:
    """The receive window the client's TCP last advertised, read from Linux's ``TCP_INFO``.

    A client whose application reads keeps its window open; one that stopped reading lets
    every byte that arrives shrink it, long before the buffers on either side fill (megabytes,
    at a stream's few kilobytes a second: minutes). ``sample`` gives the window and its
    granularity (the client's window scale), or None where the kernel does not tell.
    """

    __slots__ = ("_sock",)

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def sample(self) -> tuple[int, int] | None:
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except (OSError, AttributeError):
            return None
        if len(info) < _TCP_INFO_LEN:
            return None
        # tcpi_snd_wnd, and tcpi_snd_wscale (the low half of the seventh byte).
        window: int = _U32.unpack_from(info, 228)[0]
        return window, 1 << (info[6] & 0x0F)


class DisconnectNotice:
    """Calls its ``listener`` (once, if one is set) when the client's connection is gone
    before the response is complete."""

    __slots__ = ("listener",)

    def __init__(self) -> None:
        self.listener: Callable[[], None] | None = None

    def fire(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener()
