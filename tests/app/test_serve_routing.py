"""``rankgate serve`` as a process, configured the way a container is (``RANKGATE_*``), with the
bundled mock engine: its router is built from those settings, routes a repeated prompt back to
the rank that cached it, says so in ``x-rankgate-route`` and counts it on ``/metrics``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.app.processes import wait_ready
from tests.app.test_route_header import route_of
from tests.support.polling import wait_until
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MOCK_MODEL = "rankgate-mock"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("serve") / "gateway.log"
    port = free_port()
    env = {
        **os.environ,
        "RANKGATE_PORT": str(port),
        "RANKGATE_POLICY": "kv",
        "RANKGATE_MOCK_SPEED": "0",
        "RANKGATE_ROUTE_DECODE_WEIGHT": "0.25",
        "RANKGATE_KV_REPLAY_TIMEOUT": "1.5",
    }
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "rankgate.app.cli", "serve", "--route-hot-spill-requests", "3"],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, process, 60, log)
            yield url, log
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def test_the_served_router_uses_the_operators_settings(served: tuple[str, Path]) -> None:
    _, log = served
    text = log.read_text()
    assert "routing (pure Python): RoutingConfig(policy='kv'" in text, text
    assert "decode_weight=0.25" in text
    assert "hot_spill_requests=3" in text
    assert "replay_timeout=1.5" in text


def test_a_repeated_prompt_returns_to_its_rank_through_the_served_gateway(
    served: tuple[str, Path],
) -> None:
    url, _ = served
    prompt = [1000 + (i * 7) % 1500 for i in range(300)]
    body = {"model": MOCK_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    with httpx.Client(base_url=url, timeout=30) as http:
        first = route_of(http.post("/v1/completions", json=body))
        assert first["policy"] == "kv"
        routes: list[dict[str, str]] = []

        def cached() -> bool:
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            routes.append(route_of(response))
            return int(routes[-1]["cached"]) >= 256

        # Until its KV events arrive, the router's short-lived prediction holds the prefix.
        wait_until(cached, 10, lambda: f"the prefix was not seen cached: {routes[-1]}")
        assert routes[-1]["rank"] == first["rank"]
        metrics = http.get("/metrics").text
    assert f'rankgate_routing_requests_total{{policy="kv",rank="{first["rank"]}"}}' in metrics
    assert "rankgate_kv_event_batches_total" in metrics
