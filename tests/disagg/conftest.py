"""A prefill and a decode mock engine (DP=2 each) behind a real gateway, as clients see it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.mocker.config import MockEngineConfig
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.sidecar import DisaggConfig
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.mock_engine import MockEngineHandle, RankStats, running_mock_engine
from tests.support.ports import free_port, free_port_range

MODEL = "tiny-llama"
DP = 2
# The tests' short prompts would be prefilled on the decode engine by the per-request choice;
# most of them are about the remote path, so they pin it.
REMOTE_PREFILLS = DisaggConfig(prefill_mode="remote")


def engine_config(role: str, **overrides: Any) -> MockEngineConfig:
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "dp_size": DP,
        "block_size": 16,
        "model": MODEL,
        "tokenizer": str(TINY_TOKENIZER),
        "kv_events_port": free_port_range(DP),
        "kv_replay_port": free_port_range(DP),
        "max_model_len": 2048,
        "role": role,
    }
    settings.update(overrides)
    return MockEngineConfig(**settings)


@dataclass(frozen=True)
class Pair:
    prefill: MockEngineHandle
    decode: MockEngineHandle

    def totals(self, side: str) -> RankStats:
        """The side's counters summed over its ranks."""
        handle = self.prefill if side == "prefill" else self.decode
        stats = [handle.stats(rank) for rank in handle.ranks]
        values = {
            name: sum(getattr(s, name) for s in stats)
            for name in RankStats.__dataclass_fields__
            if name != "rank"
        }
        return RankStats(rank=-1, **values)

    def idle(self) -> bool:
        return all(self.totals(side).active == 0 for side in ("prefill", "decode"))


@contextmanager
def engine_pair(
    prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
) -> Iterator[Pair]:
    with (
        running_mock_engine(engine_config("prefill", **(prefill or {}))) as p,
        running_mock_engine(engine_config("decode", **(decode or {}))) as d,
    ):
        yield Pair(p, d)


@contextmanager
def gateway_url(pair: Pair, **settings: Any) -> Iterator[str]:
    config = GatewaySettings(
        prefill_engine=pair.prefill.target,
        decode_engine=pair.decode.target,
        tokenizer=str(TINY_TOKENIZER),
        startup_timeout=20.0,
        **{"disagg": REMOTE_PREFILLS, **settings},
    )
    with serve_app(create_app(config, media=MediaPreparer(MediaConfig()))) as url:
        yield url


def chat_body(text: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
    }
    body.update(fields)
    return body
