"""The demo engine that ``rankgate serve`` starts without ``--engine``: discoverable as a
DP=2 vLLM with KV events and the shipped tokenizer, generating, and gone when its block ends."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from rankgate.mocker import demo as demo_module
from rankgate.mocker.demo import DP_SIZE, MODEL, demo_engine, tiny_tokenizer_dir
from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.types import PreparedRequest, SamplingParams, StoppingParams
from tests.sidecar.routers import FixedRouter


async def test_the_demo_engine_serves_as_a_dp_group_and_stops_with_its_block() -> None:
    with demo_engine(speed=0.0) as demo:
        assert demo.tokenizer == str(tiny_tokenizer_dir())
        sidecar = Sidecar(SidecarConfig(endpoint=demo.target, startup_timeout=10), FixedRouter(1))
        await sidecar.start()
        try:
            info = sidecar.info
            assert info.served_model_name == MODEL
            assert info.model_id == demo.tokenizer
            assert info.ranks == tuple(range(DP_SIZE))
            assert len(info.kv_event_sources) == DP_SIZE
            request = PreparedRequest(
                request_id="demo-1",
                prompt_token_ids=(1, 2, 3),
                sampling=SamplingParams(temperature=0.0),
                stopping=StoppingParams(max_tokens=3, ignore_eos=True),
            )
            deltas = [delta async for delta in sidecar.generate(request)]
        finally:
            await sidecar.close()
        assert deltas[0].rank == 1
        assert sum(len(delta.token_ids) for delta in deltas) == 3
        assert deltas[-1].finish_reason == "length"
        host, port = demo.target.rsplit(":", 1)
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect((host, int(port)))


async def test_an_operator_tokenizer_is_the_one_served(tmp_path: Path) -> None:
    own = tmp_path / "tokenizer"
    shutil.copytree(tiny_tokenizer_dir(), own)
    with demo_engine(tokenizer=str(own), speed=0.0) as demo:
        assert demo.tokenizer == str(own)
        sidecar = Sidecar(SidecarConfig(endpoint=demo.target, startup_timeout=10), FixedRouter())
        await sidecar.start()
        try:
            assert sidecar.info.model_id == str(own)
        finally:
            await sidecar.close()


@pytest.mark.parametrize("taken_rank", range(DP_SIZE))
async def test_a_kv_port_taken_after_its_probe_gets_a_fresh_run(
    monkeypatch: pytest.MonkeyPatch, taken_rank: int
) -> None:
    """Another process may bind a probed port before the engine does: the start closes what
    it opened (the ranks before the taken one included) and goes on with ports of its own."""
    base = demo_module._free_port_run(DP_SIZE)
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", base + taken_rank))
    except OSError:
        pytest.skip("the probed port was taken meanwhile")
    taken.listen()
    real = demo_module._free_port_run
    handed: list[int] = []

    def stale_then_free(count: int) -> int:
        port = base if len(handed) < 2 else real(count)
        handed.append(port)
        return port

    monkeypatch.setattr(demo_module, "_free_port_run", stale_then_free)
    try:
        with demo_engine(speed=0.0) as demo:
            sidecar = Sidecar(
                SidecarConfig(endpoint=demo.target, startup_timeout=10), FixedRouter()
            )
            await sidecar.start()
            try:
                sources = sidecar.info.kv_event_sources
            finally:
                await sidecar.close()
    finally:
        taken.close()
    assert handed[:2] == [base, base]
    assert len(handed) == 4
    assert len(sources) == DP_SIZE
