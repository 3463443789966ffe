"""KV-event publishers that connect instead of binding (vLLM does so for any endpoint without
``*``/``::`` that is not ipc/inproc, e.g. ``tcp://127.0.0.1:P`` for a gateway beside it): the
gateway binds their address, retries while it is taken, and routes on what arrives.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import Iterator

import httpx
import pytest
import zmq
from prometheus_client import CollectorRegistry

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.server import create_app
from rankgate.mocker.config import MockEngineConfig
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.types import KvEventSource
from tests.app.serving import serve_app
from tests.app.test_route_header import route_of, served_on
from tests.conftest import TINY_TOKENIZER
from tests.routing.conftest import BLOCK, engine_info, prepared, sample
from tests.routing.publisher import TestPublisher, encode_batch, stored
from tests.routing.test_gateway_routing import Rig
from tests.support.mock_engine import MockEngineHandle, running_mock_engine
from tests.support.polling import until, wait_until
from tests.support.ports import free_port, free_port_range

MODEL = "connect-llm"
DP = 2
# The block size of test_gateway_routing's Rig, which this module reuses.
MOCK_BLOCK = 16


async def test_the_intake_binds_a_connecting_publishers_address_once_it_is_free() -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    # Something else holds the address when the router starts: it must keep retrying.
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    registry = CollectorRegistry()
    router = build_router(RoutingConfig(pending_ttl=0.0), registry)
    router.configure(engine_info((0,), sources=[KvEventSource(0, endpoint, None, "kv", bind=True)]))
    await router.start()
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        # start() returns once the intake has opened its sockets: its first bind has failed.
        blocker.close()
        pub.connect(endpoint)
        # The subscription arrives once the intake has bound the address and we reached it.
        assert await asyncio.to_thread(pub.poll, 10_000), "the intake never bound the address"
        assert pub.recv()[:1] == b"\x01"
        tokens = list(range(100, 100 + 3 * BLOCK))
        batch = encode_batch([stored([1, 2, 3], tokens, block_size=BLOCK)], 0)
        pub.send_multipart((b"kv", (0).to_bytes(8, "big"), batch))
        await until(
            lambda: (
                sample(registry, "rankgate_kv_event_batches_total", rank="0", origin="live") >= 1
            ),
            5,
            "a live batch counted",
        )
        ticket = router.route(prepared([*tokens, 7]))
        ticket.finished()
        assert ticket.decision.cached_tokens == 3 * BLOCK
    finally:
        blocker.close()
        pub.close(linger=0)
        context.term()
        await router.close()


async def test_batches_a_connecting_publisher_sent_before_its_link_was_up_are_replayed() -> None:
    """Nothing more arrives live, so only polling the replay buffer can recover them."""
    publisher = TestPublisher(0, replay=True)
    tokens = list(range(200, 200 + 4 * BLOCK))
    publisher.publish([stored([1, 2, 3, 4], tokens, block_size=BLOCK)], deliver=False)
    registry = CollectorRegistry()
    router = build_router(RoutingConfig(pending_ttl=0.0), registry)
    source = KvEventSource(
        0, f"tcp://127.0.0.1:{free_port()}", publisher.replay_endpoint, "kv", bind=True
    )
    router.configure(engine_info((0,), sources=[source]))
    await router.start()
    try:
        # The intake thread counts the replayed batch, then the replay that brought it: wait
        # for both before reading either.
        await until(
            lambda: (
                sample(registry, "rankgate_kv_event_batches_total", rank="0", origin="replay") >= 1
                and sample(registry, "rankgate_kv_event_replays_total", rank="0", outcome="sync")
                >= 1
            ),
            5,
            "a replayed batch and its replay counted",
        )
        ticket = router.route(prepared([*tokens, 9]))
        ticket.finished()
        assert ticket.decision.cached_tokens == 4 * BLOCK
        assert sample(registry, "rankgate_kv_event_replays_total", rank="0", outcome="sync") == 1
        assert publisher.replay_requests[0] == 0
    finally:
        await router.close()
        publisher.close()


@pytest.fixture(scope="module")
def connect_rig() -> Iterator[Rig]:
    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=DP,
        block_size=MOCK_BLOCK,
        model=MODEL,
        tokenizer=str(TINY_TOKENIZER),
        model_id=str(TINY_TOKENIZER),
        kv_events_port=free_port_range(DP),
        kv_replay_port=free_port_range(DP),
        # A concrete host: the engine's publishers connect to the gateway.
        kv_events_host="127.0.0.1",
        speed=0.0,
    )
    handle: MockEngineHandle
    with running_mock_engine(config) as handle:
        argv = ["serve", "--engine", handle.target, "--tokenizer", str(TINY_TOKENIZER)]
        settings = settings_from_args(build_parser().parse_args(argv))
        with (
            serve_app(create_app(settings)) as url,
            httpx.Client(base_url=url, timeout=60) as http,
        ):
            yield Rig(handle, http, url)


def test_kv_routing_works_with_publishers_that_connect(connect_rig: Rig) -> None:
    rig = connect_rig
    rng = random.Random(9)
    prompt = [rng.randrange(100, 3000) for _ in range(20 * MOCK_BLOCK + 3)]
    routes = []
    for turn in range(2):
        rid = f"connect-{turn}-{os.urandom(3).hex()}"
        response = rig.http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0,
                "request_id": rid,
            },
        )
        assert response.status_code == 200, response.text
        route = route_of(response)
        assert served_on(rig.engine, rid) == int(route["rank"])
        routes.append(route)
        if turn == 0:
            rig.handle.wait_idle()
            rig.wait_metric(
                "rankgate_routing_index_blocks", 20, rank=route["rank"], medium="device"
            )
    first, second = routes
    assert second["rank"] == first["rank"]
    assert int(second["cached"]) == 20 * MOCK_BLOCK
    # The batch may arrive live or, when the link came up after it was sent, from the replay
    # poll; either way it reached the index through the connect-mode intake.
    delivered = sum(
        rig.metric("rankgate_kv_event_batches_total", origin=origin)
        for origin in ("live", "replay")
    )
    assert delivered >= 1
    wait_until(
        lambda: rig.handle.stats(int(first["rank"])).cached_tokens >= 20 * MOCK_BLOCK,
        5,
        lambda: f"{rig.handle.stats(int(first['rank'])).cached_tokens} tokens cached",
    )
