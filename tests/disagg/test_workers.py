"""``rankgate serve --workers 2`` in front of a prefill/decode pair: both sides' load is shared
between the workers (each side on a board of its own, since rank ids repeat across sides), and
``/metrics`` reports both sides' routing, each series labelled with its side."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.app.test_metrics import value
from tests.app.test_workers import ROOT, _wait_ready
from tests.conftest import TINY_TOKENIZER
from tests.disagg.conftest import MODEL, Pair, engine_pair
from tests.support.ports import free_port

# Each prompt prefills for about a second on the slowed prefill engine.
SLOW_PREFILL = {"prefill_seconds_per_token": 4e-3}
COUNT = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Pair]]:
    log = tmp_path_factory.mktemp("pd-workers") / "gateway.log"
    port = free_port()
    with engine_pair(prefill=SLOW_PREFILL) as pair, log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "rankgate.app.cli", "serve", "--workers", "2",
                "--prefill-engine", pair.prefill.target, "--decode-engine", pair.decode.target,
                "--pd-prefill", "remote", "--tokenizer", str(TINY_TOKENIZER),
                "--port", str(port), "--policy", "load",
            ],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, process)
            yield url, pair
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                assert process.wait(60) == 0
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
                raise


def scrape(url: str) -> str:
    # A new connection per scrape, so scrapes land on either worker.
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    return response.text


def ask(url: str, i: int, outcomes: list[int]) -> None:
    body = {
        "model": MODEL,
        "prompt": " ".join(f"p{i}w{j}" for j in range(60)),
        "max_tokens": 4,
    }
    with httpx.Client(timeout=60) as client:
        outcomes.append(client.post(f"{url}/v1/completions", json=body).status_code)


def test_both_sides_load_is_shared_and_labelled_by_side(served: tuple[str, Pair]) -> None:
    url, pair = served
    outcomes: list[int] = []
    threads = [threading.Thread(target=ask, args=(url, i, outcomes)) for i in range(COUNT)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while pair.totals("prefill").running + pair.totals("prefill").waiting < COUNT:
        assert time.monotonic() < deadline, "the prefills did not all start"
        time.sleep(0.02)
    # Every worker's prefill router counts all of them, wherever they were sent from; the
    # decode side has none yet.
    for _ in range(6):
        text = scrape(url)
        assert value(text, "rankgate_routing_in_flight_requests", side="prefill") == COUNT
        assert value(text, "rankgate_routing_in_flight_requests", side="decode") == 0
    for thread in threads:
        thread.join(60)
    assert outcomes == [200] * COUNT
    text = scrape(url)
    deadline = time.monotonic() + 10
    while value(text, "rankgate_routing_requests_total", side="decode") < COUNT:
        assert time.monotonic() < deadline, "the decode side's count never reached the total"
        time.sleep(0.2)
        text = scrape(url)
    assert value(text, "rankgate_routing_requests_total", side="prefill") == COUNT
    assert value(text, "rankgate_routing_in_flight_requests", side="prefill") == 0
    assert value(text, "rankgate_pd_prefills_total", where="remote", reason="pinned") == COUNT


def test_the_metrics_name_no_rank_without_its_side(served: tuple[str, Pair]) -> None:
    text = scrape(served[0])
    for line in text.splitlines():
        if line.startswith("rankgate_routing_") and 'rank="' in line:
            assert 'side="' in line, line
