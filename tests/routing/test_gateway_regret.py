"""The router checking itself, through ``rankgate serve`` against the mocker (DP=2, KV events):
on a consistent engine every prediction comes true; each way a rank's view goes wrong (its
publisher stops, events are lost past the replay buffer, another block size, corrupted token
ids) routes that rank by load alone, shown on ``/metrics``, until its events are right again.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.metrics import metric_total
from tests.support.mock_engine import MockEngineHandle, kv_mock_config, running_mock_engine
from tests.support.polling import wait_until

MODEL = "regret-llm"
DP = 2
BLOCK = 16
STRIKES = 2


class Rig:
    def __init__(self, handle: MockEngineHandle, http: httpx.Client) -> None:
        self.handle = handle
        self.http = http

    def metric(self, name: str, **labels: str) -> float:
        return metric_total(self.http, name, **labels)

    def chat(self, text: str, rank: int | None = None, **fields: Any) -> dict[str, Any]:
        headers = {} if rank is None else {"x-data-parallel-rank": str(rank)}
        response = self.http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 1,
                "temperature": 0,
                **fields,
            },
            headers=headers,
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def trusted(self, rank: int) -> float:
        return self.metric("rankgate_routing_kv_view_trusted", rank=str(rank))

    def until(self, condition: Callable[[], bool], rank: int, what: str) -> None:
        """Send fresh prompts to ``rank`` until ``condition`` holds: each request is a routing
        decision, which is when the router scores the requests whose events are due."""

        def decided() -> bool:
            if condition():
                return True
            self.chat(fresh(), rank)
            return False

        wait_until(decided, 30, what)


def fresh() -> str:
    """A prompt of several blocks no rank has seen."""
    tag = os.urandom(6).hex()
    return " ".join(f"{tag} says the quick brown fox number {i} jumps." for i in range(8))


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with running_mock_engine(kv_mock_config(MODEL, dp_size=DP, block_size=BLOCK)) as handle:
        argv = [
            "serve",
            "--engine", handle.target,
            "--tokenizer", str(TINY_TOKENIZER),
            "--startup-timeout", "30",
            "--route-regret-settle", "0.2",
            "--route-trust-strikes", str(STRIKES),
            # A request a millisecond per rank: one after another, nearly all are measured.
            "--route-regret-interval", "0.001",
        ]  # fmt: skip
        settings = settings_from_args(build_parser().parse_args(argv))
        with (
            serve_app(create_app(settings)) as url,
            httpx.Client(base_url=url, timeout=60) as http,
        ):
            yield Rig(handle, http)


def test_on_a_consistent_engine_every_prediction_comes_true(rig: Rig) -> None:
    measured = "rankgate_routing_measured_requests_total"
    before = {
        name: rig.metric(name)
        for name in (
            measured,
            "rankgate_routing_predicted_hit_tokens_total",
            "rankgate_routing_realised_hit_tokens_total",
        )
    }
    hits = "rankgate_routing_predicted_hit_tokens_total"

    def conversation(n: int) -> bool:
        # Turns of growing history, each cached where the last went. The meter measures the
        # first request a rank gets in each interval, so a turn may go unmeasured, and a
        # measured one find the blocks of an unmeasured one still to be announced.
        history = fresh()
        for turn in range(3):
            history += f" Turn {turn} of conversation {n} adds a few more words to it."
            rig.chat(history)
        return rig.metric(measured) >= before[measured] + 18 and rig.metric(hits) > before[hits]

    conversations = itertools.count()
    wait_until(
        lambda: conversation(next(conversations)), 30, "a turn with a predicted hit measured"
    )
    predicted = rig.metric("rankgate_routing_predicted_hit_tokens_total")
    realised = rig.metric("rankgate_routing_realised_hit_tokens_total")
    assert predicted - before["rankgate_routing_predicted_hit_tokens_total"] > 0
    assert predicted - before["rankgate_routing_predicted_hit_tokens_total"] == (
        realised - before["rankgate_routing_realised_hit_tokens_total"]
    )
    assert rig.metric("rankgate_routing_hit_error_tokens_total") == 0
    assert rig.trusted(0) == rig.trusted(1) == 1


@pytest.mark.parametrize(
    ("distortion", "reason"),
    [
        ({"silent": True}, "silent"),
        ({"block_size": 2 * BLOCK}, "block_size"),
        ({"token_offset": 1}, "mismatch"),
    ],
    ids=["publisher-stopped", "block-size", "token-ids"],
)
def test_a_rank_whose_events_go_wrong_is_routed_by_load_until_they_are_right(
    rig: Rig, distortion: dict[str, Any], reason: str
) -> None:
    rank = 1
    counted = rig.metric("rankgate_routing_kv_view_distrusted_total", reason=reason)
    rig.handle.faults.distort_kv_events(rank, **distortion)
    try:
        rig.until(lambda: rig.trusted(rank) == 0, rank, f"rank {rank} stayed trusted")
        assert rig.trusted(0) == 1
        assert rig.metric("rankgate_routing_kv_view_distrusted_total", reason=reason) == (
            counted + 1
        )
        # Its view no longer counts: a prompt it holds by its own events is credited nothing.
        text = fresh()
        rig.chat(text, rank)
        route = rig.http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 1,
            },
            headers={"x-data-parallel-rank": str(rank)},
        ).headers["x-rankgate-route"]
        assert f"rank={rank};cached=0/" in route
    finally:
        rig.handle.faults.distort_kv_events(rank)
    rig.until(lambda: rig.trusted(rank) == 1, rank, f"rank {rank} was never trusted again")


def test_events_lost_past_the_replay_buffer_distrust_the_rank_until_fresh_ones(rig: Rig) -> None:
    rank = 0
    gaps = rig.metric("rankgate_routing_kv_view_distrusted_total", rank=str(rank), reason="gap")
    rig.handle.faults.distort_kv_events(rank, lose_dropped=True)
    rig.handle.faults.drop_kv_batches(3, rank)
    try:
        # The next batch shows the gap, replay cannot cover it, the rank's index is purged.
        rig.until(
            lambda: (
                rig.metric(
                    "rankgate_routing_kv_view_distrusted_total", rank=str(rank), reason="gap"
                )
                > gaps
            ),
            rank,
            "the gap never distrusted the rank",
        )
    finally:
        rig.handle.faults.distort_kv_events(rank)
    rig.until(lambda: rig.trusted(rank) == 1, rank, "fresh events never restored trust")
