"""The guarded transport on its own: httpcore's errors arrive as httpx's, from the connection
and from the body alike, and a refused address is the policy's own refusal."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpcore
import httpx
import pytest

from rankgate.multimodal.addresses import AddressPolicy
from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.transport import GuardedTransport, as_httpx_error

LIMITS = httpx.Limits(max_connections=4, max_keepalive_connections=4)


@pytest.mark.parametrize(
    ("core", "mapped"),
    [
        (httpcore.ConnectTimeout, httpx.ConnectTimeout),
        (httpcore.ReadTimeout, httpx.ReadTimeout),
        (httpcore.WriteTimeout, httpx.WriteTimeout),
        (httpcore.PoolTimeout, httpx.PoolTimeout),
        (httpcore.ConnectError, httpx.ConnectError),
        (httpcore.ReadError, httpx.ReadError),
        (httpcore.WriteError, httpx.WriteError),
        (httpcore.ProxyError, httpx.ProxyError),
        (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
        (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
        (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    ],
)
def test_each_httpcore_error_becomes_its_httpx_twin(
    core: type[Exception], mapped: type[Exception]
) -> None:
    error = as_httpx_error(core("what went wrong"))
    assert type(error) is mapped
    assert str(error) == "what went wrong"


def test_other_errors_pass_as_they_are() -> None:
    refusal = MediaRefused("no")
    assert as_httpx_error(refusal) is refusal


@pytest.fixture
def short_body_server() -> Iterator[str]:
    """Promises 100 bytes, sends 10, hangs up."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/x.png"
    listener.close()


async def test_a_body_cut_short_is_httpx_remote_protocol_error(short_body_server: str) -> None:
    transport = GuardedTransport(AddressPolicy(["127.0.0.0/8"]), LIMITS)
    async with (
        httpx.AsyncClient(transport=transport) as client,
        client.stream("GET", short_body_server) as response,
    ):
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            await response.aread()


async def test_a_closed_port_is_httpx_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    transport = GuardedTransport(AddressPolicy(["127.0.0.0/8"]), LIMITS)
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/x.png")


async def test_an_address_the_policy_refuses_is_never_connected() -> None:
    transport = GuardedTransport(AddressPolicy(), LIMITS)
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(MediaRefused, match="loopback"):
            await client.get("http://127.0.0.1:9/x.png")
