"""``rankgate serve --workers 2`` in front of a prefill/decode pair: both sides' load is shared
between the workers (each side on a board of its own, since rank ids repeat across sides), and
``/metrics`` reports both sides' routing, each series labelled with its side."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.app.test_metrics import value
from tests.app.test_workers import ROOT, _wait_ready
from tests.conftest import TINY_TOKENIZER
from tests.disagg.conftest import MODEL, Pair, engine_pair
from tests.support.polling import wait_until
from tests.support.ports import free_port

COUNT = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Pair]]:
    log = tmp_path_factory.mktemp("pd-workers") / "gateway.log"
    port = free_port()
    with engine_pair() as pair, log.open("wb") as sink:
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


def in_flight(text: str) -> dict[str, float]:
    return {
        side: value(text, "rankgate_routing_in_flight_requests", side=side)
        for side in ("prefill", "decode")
    }


def test_both_sides_load_is_shared_and_labelled_by_side(served: tuple[str, Pair]) -> None:
    url, pair = served
    outcomes: list[int] = []
    threads = [threading.Thread(target=ask, args=(url, i, outcomes)) for i in range(COUNT)]
    # The prefill engine holds every request where it is until the scrapes are done: a prefill
    # that finished between two scrapes would rightly leave the count, so the state asserted
    # below must be one that lasts, however slowly the scrapes come on a busy machine.
    pair.prefill.faults.hold_steps()
    try:
        for thread in threads:
            thread.start()

        def queued() -> int:
            prefill = pair.totals("prefill")
            return prefill.running + prefill.waiting

        wait_until(
            lambda: queued() == COUNT,
            30,
            lambda: f"the prefill engine holds {queued()} of the {COUNT} prefills",
        )
        # Each request was counted on its worker's row of the board before it was sent, so
        # every worker's prefill router counts all of them, wherever they were sent from,
        # at once; the decode side has none yet.
        for scrape_number in range(6):
            seen = in_flight(scrape(url))
            assert seen == {"prefill": COUNT, "decode": 0}, (
                f"scrape {scrape_number} showed {seen} in flight while the prefill engine "
                f"held {queued()} requests"
            )
    finally:
        pair.prefill.faults.release_steps()
    for thread in threads:
        thread.join(60)
    assert outcomes == [200] * COUNT

    def decoded() -> float:
        return value(scrape(url), "rankgate_routing_requests_total", side="decode")

    wait_until(
        lambda: decoded() == COUNT,
        10,
        lambda: f"the decode side counted {decoded()} of {COUNT} requests",
    )
    text = scrape(url)
    assert value(text, "rankgate_routing_requests_total", side="prefill") == COUNT
    assert value(text, "rankgate_routing_in_flight_requests", side="prefill") == 0
    assert value(text, "rankgate_pd_prefills_total", where="remote", reason="pinned") == COUNT


def test_the_metrics_name_no_rank_without_its_side(served: tuple[str, Pair]) -> None:
    text = scrape(served[0])
    for line in text.splitlines():
        if line.startswith("rankgate_routing_") and 'rank="' in line:
            assert 'side="' in line, line
