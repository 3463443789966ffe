"""A gateway restarted beside a running engine routes on the caches at once: the KV index is
saved when it stops (``--route-index-file``) and loaded when it starts, and what the engine
published meanwhile is replayed from where the saved index ends. Without the file, a replay
buffer that has rolled past the engine's early events leaves the new gateway blind to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.metrics import metric_total
from tests.support.mock_engine import (
    MockEngineHandle,
    generate_on,
    kv_mock_config,
    running_mock_engine,
)
from tests.support.polling import wait_until

MODEL = "restart-llm"
DP = 2
BLOCK = 16
# The publisher keeps only the last few batches for replay, as a busy vLLM would.
REPLAY_BATCHES = 4


@pytest.fixture(scope="module")
def mock() -> Iterator[MockEngineHandle]:
    config = kv_mock_config(
        MODEL, dp_size=DP, block_size=BLOCK, kv_replay_buffer_steps=REPLAY_BATCHES
    )
    with running_mock_engine(config) as handle:
        yield handle


def gateway(mock: MockEngineHandle, *flags: str) -> Any:
    argv = [
        "serve",
        "--engine", mock.target,
        "--tokenizer", str(TINY_TOKENIZER),
        "--startup-timeout", "30",
        "--route-pending-ttl", "0",
        *flags,
    ]  # fmt: skip
    return serve_app(create_app(settings_from_args(build_parser().parse_args(argv))))


def prompt_ids(tag: str, blocks: int = 6) -> list[int]:
    seed = int.from_bytes(tag.encode()[:6].ljust(6, b"\0"), "big")
    return [300 + (seed * 7919 + i * 104729) % 700 for i in range(blocks * BLOCK)]


def pin(mock: MockEngineHandle, rank: int, ids: list[int]) -> None:
    """A request straight to the engine on ``rank``, with no gateway in between."""
    generate_on(mock.target, rank, ids)


def route(http: httpx.Client, ids: list[int]) -> tuple[int, int]:
    """The rank the gateway sends ``ids`` plus a tail to, and the tokens it believes cached."""
    response = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": [*ids, 5, 6, 7], "max_tokens": 1},
    )
    assert response.status_code == 200, response.text
    fields = dict(
        part.split("=", 1)
        for part in response.headers["x-rankgate-route"].split(";")
        if "=" in part
    )
    return int(fields["rank"]), int(fields["cached"].split("/")[0])


def indexed(http: httpx.Client, rank: int) -> float:
    return metric_total(http, "rankgate_routing_index_blocks", medium="device", rank=str(rank))


def wait_indexed(http: httpx.Client, rank: int, blocks: float) -> None:
    wait_until(
        lambda: indexed(http, rank) >= blocks,
        10,
        lambda: f"rank {rank} indexed {indexed(http, rank)} of {blocks} blocks",
    )


def test_a_restarted_gateway_routes_on_the_caches_at_once(
    mock: MockEngineHandle, tmp_path: Path
) -> None:
    saved = str(tmp_path / "kv-index")
    early = prompt_ids("early")
    with gateway(mock, "--route-index-file", saved) as url, httpx.Client(base_url=url) as http:
        pin(mock, 1, early)
        # More traffic than the replay buffer holds, so replay alone cannot find ``early``.
        for n in range(2 * REPLAY_BATCHES):
            pin(mock, 0, prompt_ids(f"filler{n}", 1))
        wait_indexed(http, 1, len(early) // BLOCK)
    assert Path(saved).exists()
    # Published while no gateway listens: replayed from where the saved index ends.
    meanwhile = prompt_ids("meanwhile")
    pin(mock, 0, meanwhile)

    with gateway(mock, "--route-index-file", saved) as url, httpx.Client(base_url=url) as http:
        assert route(http, early) == (1, len(early))
        # The replay from where the saved index ends is asked for as the gateway starts.
        wait_until(
            lambda: metric_total(
                http, "rankgate_kv_event_replays_total", outcome="complete", rank="0"
            ),
            10,
            "the batch published meanwhile replayed",
        )
        assert route(http, meanwhile) == (0, len(meanwhile))

    # The same restart without the file: the early prompt is lost to the rolled buffer.
    with gateway(mock) as url, httpx.Client(base_url=url) as http:
        assert route(http, early)[1] == 0


def test_an_index_saved_beside_another_engine_is_not_loaded(
    mock: MockEngineHandle, tmp_path: Path
) -> None:
    saved = tmp_path / "kv-index"
    early = prompt_ids("other-engine")
    with gateway(mock, "--route-index-file", str(saved)) as url, httpx.Client(base_url=url) as h:
        pin(mock, 1, early)
        wait_indexed(h, 1, len(early) // BLOCK)
    data = saved.read_bytes()
    instance = mock.server.config.model_id.encode()
    assert instance in data
    # Another engine (here: another model id in the identity) must not inherit it.
    saved.write_bytes(data.replace(instance, instance[:-1] + b"X"))
    for n in range(2 * REPLAY_BATCHES):
        pin(mock, 0, prompt_ids(f"more{n}", 1))
    with gateway(mock, "--route-index-file", str(saved)) as url, httpx.Client(base_url=url) as h:
        assert route(h, early)[1] == 0
