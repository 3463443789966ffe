"""Address checks on resolved IPs, the allow-list, and the connect-time guard."""

from __future__ import annotations

import asyncio
import re

import pytest

from rankgate.multimodal.addresses import AddressPolicy, GuardedBackend, system_resolver
from rankgate.multimodal.errors import MediaRefused
from tests.multimodal.conftest import PUBLIC_IP, table_resolver


@pytest.mark.parametrize(
    ("host", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("[::1]", "loopback"),
        ("10.0.0.8", "private"),
        ("172.16.4.4", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("fd00:ec2::254", "private"),
        ("100.64.0.1", "not globally routable"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("::ffff:127.0.0.1", "loopback"),
        ("64:ff9b::a9fe:a9fe", "link-local"),
        ("2002:7f00:1::", "loopback"),
        # ipaddress calls these global: IPv4-compatible (::/96) and site-local (fec0::/10).
        ("::127.0.0.1", "IPv4-compatible"),
        ("::8.8.8.8", "IPv4-compatible"),
        ("::a9fe:a9fe", "IPv4-compatible"),
        ("fec0::1", "site-local"),
        ("feff:ffff::1", "site-local"),
        ("64:ff9b:1::a9fe:a9fe", "link-local"),
        ("[::]", "unspecified"),
    ],
)
async def test_non_public_literals_are_refused(host: str, kind: str) -> None:
    with pytest.raises(MediaRefused, match=f"an? {kind} address; fetching it is not allowed"):
        await AddressPolicy().resolve_allowed(host, 80)


async def test_public_addresses_pass() -> None:
    policy = AddressPolicy(resolver=table_resolver)
    assert await policy.resolve_allowed("8.8.8.8", 443) == ("8.8.8.8",)
    assert await policy.resolve_allowed("images.example.com", 80) == (PUBLIC_IP,)
    assert len(await policy.resolve_allowed("cdn.example.com", 80)) == 2


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("intranet.example.com", "10.1.2.3"),
        ("mixed.example.com", "192.168.0.7"),
        ("metadata.example.com", "169.254.169.254"),
    ],
)
async def test_names_are_judged_by_every_resolved_address(host: str, address: str) -> None:
    policy = AddressPolicy(resolver=table_resolver)
    with pytest.raises(MediaRefused, match=re.escape(f"host {host} resolves to {address}")):
        await policy.resolve_allowed(host, 80)


async def test_allow_list_admits_listed_networks_only() -> None:
    policy = AddressPolicy(["127.0.0.0/8", "10.1.0.0/16"], resolver=table_resolver)
    assert await policy.resolve_allowed("127.0.0.1", 80) == ("127.0.0.1",)
    assert await policy.resolve_allowed("intranet.example.com", 80) == ("10.1.2.3",)
    with pytest.raises(MediaRefused, match="private"):
        await policy.resolve_allowed("10.2.0.1", 80)


async def test_unresolvable_host_is_refused() -> None:
    with pytest.raises(MediaRefused, match=r"cannot resolve host nowhere\.invalid"):
        await AddressPolicy(resolver=table_resolver).resolve_allowed("nowhere.invalid", 80)


async def test_system_resolver_resolves_localhost_without_blocking() -> None:
    assert "127.0.0.1" in await system_resolver("localhost", 80) or "::1" in (
        await system_resolver("localhost", 80)
    )


async def _listener() -> tuple[asyncio.Server, int]:
    async def close_at_once(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_guarded_backend_refuses_then_allows_a_real_loopback_socket() -> None:
    server, port = await _listener()
    try:
        with pytest.raises(MediaRefused, match="loopback"):
            await GuardedBackend(AddressPolicy()).connect_tcp("127.0.0.1", port)
        stream = await GuardedBackend(AddressPolicy(["127.0.0.1/32"])).connect_tcp(
            "127.0.0.1", port
        )
        await stream.aclose()
    finally:
        server.close()
        await server.wait_closed()


async def test_guarded_backend_connects_to_the_address_it_checked() -> None:
    server, port = await _listener()
    answers = iter([["127.0.0.1"]])

    async def rebinding(host: str, port: int) -> list[str]:
        return next(answers)

    try:
        backend = GuardedBackend(AddressPolicy(["127.0.0.0/8"], resolver=rebinding))
        stream = await backend.connect_tcp("a-name.example", port)
        assert stream.get_extra_info("server_addr")[0] == "127.0.0.1"
        await stream.aclose()
    finally:
        server.close()
        await server.wait_closed()
