"""``rankgate serve --workers 2 --policy kv``: one worker takes in the engine's KV events, and
both route on them. A prefix one worker pinned to a rank is then routed to that rank, with its
cached tokens counted, by the worker that never saw the pinned request and receives no events.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from rankgate.mocker.config import MockEngineConfig
from tests.app.test_metrics import value
from tests.app.test_workers import ROOT, Gateway, _wait_ready
from tests.conftest import TINY_TOKENIZER
from tests.support.mock_engine import running_mock_engine
from tests.support.polling import wait_until
from tests.support.ports import free_port, free_port_range

DP = 2
MODEL = "kv-llama"
PINNED = 1


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=DP,
        model=MODEL,
        tokenizer=str(TINY_TOKENIZER),
        kv_events_port=free_port_range(DP),
        kv_replay_port=free_port_range(DP),
        speed=0.0,
        max_model_len=2048,
    )
    log = tmp_path_factory.mktemp("workers-kv") / "gateway.log"
    port = free_port()
    with running_mock_engine(config) as engine, log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rankgate.app.cli",
                "serve",
                "--workers",
                "2",
                "--engine",
                str(engine.target),
                "--tokenizer",
                str(TINY_TOKENIZER),
                "--port",
                str(port),
                "--policy",
                "kv",
                # What is checked is the index both workers share. The share term would rightly
                # spread the follow-ups' hot prefix once enough of them reach one rank, which on
                # a slow host happens before both workers have been seen serving.
                "--route-share-weight",
                "0",
                "--log-format",
                "json",
                "--access-log",
            ],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, process, log)
            yield Gateway(url, process, log)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                assert process.wait(60) == 0
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
                raise


def _event_threads(pid: int) -> int:
    """libzmq's own threads in ``pid`` (it names them ``ZMQbg/...``): only the KV intake makes
    a ZMQ context in a gateway."""
    return sum(
        task.joinpath("comm").read_text().startswith("ZMQbg")
        for task in Path(f"/proc/{pid}/task").iterdir()
    )


def test_one_worker_receives_the_kv_events(gateway: Gateway) -> None:
    workers = gateway.workers()
    assert len(workers) == 2
    assert sorted(_event_threads(pid) > 0 for pid in workers) == [False, True]


def _complete(url: str, prompt: str, request_id: str, pin: int | None = None) -> None:
    headers = {"X-Request-Id": request_id}
    if pin is not None:
        headers["x-data-parallel-rank"] = str(pin)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    # A client per request: a new connection, which either worker may accept.
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text


def _index_blocks(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return value(text, "rankgate_routing_index_blocks", rank=str(PINNED), medium="device")


def test_both_workers_route_a_prefix_to_the_rank_that_holds_it(gateway: Gateway) -> None:
    prefix = " ".join(f"shared{i}" for i in range(120))
    _complete(gateway.url, prefix, "pin", pin=PINNED)
    # Every worker's index view shows the blocks, whichever worker answers the scrape.
    for _ in range(6):
        wait_until(lambda: _index_blocks(gateway.url) > 0, 30)
    ids = [f"follow-{n}" for n in range(40)]
    served: set[object] = set()
    sent: list[str] = []
    with ThreadPoolExecutor(4) as pool:
        for start in range(0, len(ids), 4):
            batch = ids[start : start + 4]
            list(pool.map(lambda rid: _complete(gateway.url, f"{prefix} {rid}", rid), batch))
            sent += batch
            lines = [line for line in gateway.access_lines() if line["request_id"] in sent]
            served = {line["pid"] for line in lines}
            if len(served) == 2 and len(lines) == len(sent):
                break
    assert len(served) == 2, "every follow-up landed on one worker"
    pinned = [line for line in gateway.access_lines() if line["request_id"] == "pin"]
    assert [line["rank"] for line in pinned] == [PINNED]
    for line in lines:
        assert line["rank"] == PINNED, line
        assert int(str(line["cached_tokens"])) > 0, line
    # The worker that served the pin predicted its blocks; the other one only knew them from
    # the events the first worker took in.
    assert served - {pinned[0]["pid"]}
