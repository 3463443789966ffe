"""An idle keep-alive connection outlives the pools of the clients in front of the gateway.

A client that reuses a pooled connection just as the server closes it fails its request (it
cannot write its body, or reads no answer). Load balancers avoid the race by idling longer
than the clients they serve; so does the gateway. The gateway runs on a loop whose clock the
test moves on, so "ten seconds idle" takes no ten seconds.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import orjson
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.app.serving.connections import ConnectionLimits
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import SkewedLoop, serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.polling import wait_until

BODY = {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
IDLE_S = 10.0


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)


class Pool:
    """An aiohttp session, as a client application keeps one, counting its connections."""

    def __init__(self) -> None:
        self.opened = 0
        self.reused = 0

    def trace(self) -> aiohttp.TraceConfig:
        config = aiohttp.TraceConfig()

        async def opened(*_: object) -> None:
            self.opened += 1

        async def reused(*_: object) -> None:
            self.reused += 1

        config.on_connection_create_end.append(opened)
        config.on_connection_reuseconn.append(reused)
        return config


def test_the_default_idle_outlives_common_client_pools() -> None:
    async def aiohttp_idle() -> float:
        connector = aiohttp.TCPConnector()
        try:
            idle = connector._keepalive_timeout  # 15 s, as documented
            assert idle is not None
            return float(idle)
        finally:
            await connector.close()

    idle = ConnectionLimits().keepalive_timeout
    # aiohttp's pool, Go's net/http (90 s), curl (118 s), OkHttp (300 s).
    for client_idle in (asyncio.run(aiohttp_idle()), 90, 118, 300):
        assert idle > client_idle


@contextmanager
def _served(engine: ScriptedEngine, limits: ConnectionLimits) -> Iterator[tuple[str, SkewedLoop]]:
    loops: list[SkewedLoop] = []

    def skewed() -> SkewedLoop:
        loops.append(SkewedLoop())
        return loops[-1]

    app = create_app(GatewaySettings(connections=limits), engine=engine)
    with serve_app(app, connections=limits, loop_factory=skewed) as gateway:
        yield gateway, loops[-1]


def _swept(gateway: str, loop: SkewedLoop, seconds: float) -> None:
    """Move the gateway's clock on by ``seconds`` and wait until its deadline sweep has run
    past the moved clock: a socket whose head stopped half-way is closed by the same sweep
    that would close an idle keep-alive connection."""
    host, port = gateway.removeprefix("http://").split(":")
    marker = socket.create_connection((host, int(port)))
    try:
        marker.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: ")
        loop.skew += seconds
        marker.settimeout(0.05)

        def closed() -> bool:
            try:
                marker.recv(4096)  # a 408, or the end of the connection
            except TimeoutError:
                return False
            return True

        wait_until(closed, 30, "the gateway's sweep of the half-sent head")
    finally:
        marker.close()


@pytest.mark.parametrize("idle", [None, 5], ids=["default", "shorter-than-the-client"])
def test_a_pooled_connection_is_reused_after_ten_seconds_idle(
    engine: ScriptedEngine, idle: int | None
) -> None:
    """With the default, aiohttp's pooled connection answers after 10 s idle; the control
    with a 5 s idle timeout shows the test sees the gateway close it."""
    base = ConnectionLimits(header_timeout=IDLE_S / 2)
    limits = (
        base
        if idle is None
        else ConnectionLimits(header_timeout=IDLE_S / 2, keepalive_timeout=idle)
    )
    pool = Pool()
    with _served(engine, limits) as (gateway, loop):

        async def ask(session: aiohttp.ClientSession) -> int:
            async with session.post(
                f"{gateway}/v1/chat/completions",
                data=orjson.dumps(BODY),
                headers={"content-type": "application/json"},
            ) as response:
                await response.read()
                return response.status

        async def talk() -> list[int]:
            async with aiohttp.ClientSession(trace_configs=[pool.trace()]) as session:
                first = await ask(session)
                await asyncio.to_thread(_swept, gateway, loop, IDLE_S)
                return [first, await ask(session)]

        assert asyncio.run(talk()) == [200, 200]
    if idle is None:
        assert (pool.opened, pool.reused) == (1, 1)
    else:
        assert (pool.opened, pool.reused) == (2, 0)
