"""Loopback port allocation for servers started by tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_range(count: int) -> int:
    """Return a base port such that ``base .. base+count-1`` are all free right now.

    KV-event publishers bind ``base + rank``, so consecutive ports are needed.
    """
    for _ in range(200):
        base = free_port()
        if base + count > 65535:
            continue
        socks = []
        try:
            for offset in range(count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return base
    raise RuntimeError(f"no run of {count} free loopback ports found")
