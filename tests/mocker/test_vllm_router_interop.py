"""vllm-router 0.1.17 (an independent client of vLLM's gRPC contract) drives the mocker.

The router runs in gRPC mode with its ``kv_aware`` policy, subscribed to the mocker's ZMQ KV
events (DP=2). The test warms a long prompt on the rank the router would *not* pick by
default, by pinning it there directly, and then shows that the router sends the same chat
request to that rank because its KV events announced the blocks: the mocker's per-rank
counters prove where each request ran and that the repeats were prefix-cache hits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
from tokenizers import Tokenizer

from rankgate.mocker.config import MockEngineConfig
from tests.support.mock_engine import MockEngineHandle, generate_on, running_mock_engine
from tests.support.polling import wait_until
from tests.support.ports import free_port, free_port_range

ROUTER = shutil.which("vllm-router") or str(
    Path(os.environ.get("VIRTUAL_ENV", ".venv")) / "bin" / "vllm-router"
)
TOKENIZER_DIR = (
    Path(__file__).resolve().parents[2] / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
)
MODEL = "tiny-llama"
BLOCK = 16
API_KEY = "interop"

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not Path(ROUTER).exists(),
        reason="vllm-router is not installed (pip install -e '.[peers]' installs 0.1.17)",
    ),
]


# vllm-router's debug line for each KV-event batch it applied, without the terminal colours.
_APPLIED = re.compile(r"kv_index live sequence advanced .*?rank=(\d+) seq=(\d+)")
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class RouterProcess:
    base: str
    log: Path

    def applied(self, rank: int) -> int:
        """How many KV-event batches from ``rank`` the router has applied, by its own log."""
        text = _COLOURS.sub("", self.log.read_text())
        seqs = [int(seq) for r, seq in _APPLIED.findall(text) if int(r) == rank]
        return max(seqs) + 1 if seqs else 0


def long_message(tag: str) -> str:
    return " ".join(f"{tag}: the quick brown fox jumps over lazy dog {i}." for i in range(24))


@pytest.fixture(scope="module")
def mock() -> Iterator[MockEngineHandle]:
    config = MockEngineConfig(
        port=free_port(),
        dp_size=2,
        block_size=BLOCK,
        model=MODEL,
        tokenizer=str(TOKENIZER_DIR),
        kv_events_port=free_port_range(2),
        kv_replay_port=free_port_range(2),
        speed=0.0,
    )
    with running_mock_engine(config) as handle:
        yield handle


@pytest.fixture(scope="module")
def router(
    mock: MockEngineHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    """The router process, pointed at the mocker."""
    model_dir = tmp_path_factory.mktemp("router-model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER_DIR / name, model_dir / name)
    # The router's chat frontend reads vocab_size from the model config.
    (model_dir / "config.json").write_text(
        json.dumps({"model_type": "llama", "vocab_size": 3072, "max_position_embeddings": 4096})
    )
    port = free_port()
    kv = mock.config.kv_events_port
    assert kv is not None
    worker = f"grpc://{mock.target}"
    log = (model_dir / "router.log").open("w")
    process = subprocess.Popen(
        [
            ROUTER,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--worker-urls", worker,
            "--intra-node-data-parallel-size", "2",
            "--api-key", API_KEY,
            "--policy", "kv_aware",
            "--kv-event-source", f"{worker}=tcp://127.0.0.1:{kv},tcp://127.0.0.1:{kv + 1}",
            "--kv-event-block-size", str(BLOCK),
            "--kv-event-model", MODEL,
            "--prometheus-port", str(free_port()),
            "--log-level", "debug",
        ],
        env={**os.environ, "VLLM_ROUTER_TOKENIZER": str(model_dir)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            if process.poll() is not None:
                pytest.fail(f"vllm-router exited: {(model_dir / 'router.log').read_text()}")
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 30, "vllm-router healthy")
        yield RouterProcess(base, model_dir / "router.log")
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()


def chat(base: str, content: str) -> dict[str, Any]:
    response = httpx.post(
        f"{base}/v1/chat/completions",
        headers={"authorization": f"Bearer {API_KEY}"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 6,
            "temperature": 0,
        },
        timeout=30,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def served_by(mock: MockEngineHandle, before: dict[int, int]) -> int:
    after = {rank: mock.stats(rank).requests_served for rank in mock.ranks}
    changed = [rank for rank in mock.ranks if after[rank] != before[rank]]
    assert len(changed) == 1, f"expected exactly one rank to serve, got {before} -> {after}"
    return changed[0]


def served_counts(mock: MockEngineHandle) -> dict[int, int]:
    return {rank: mock.stats(rank).requests_served for rank in mock.ranks}


def render_prompt(content: str) -> list[int]:
    """The token ids a ChatML frontend sends for one user message."""
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    text = (
        jinja2.Environment()
        .from_string(config["chat_template"])
        .render(messages=[{"role": "user", "content": content}], add_generation_prompt=True)
    )
    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def pin(mock: MockEngineHandle, rank: int, prompt: list[int]) -> None:
    generate_on(mock.target, rank, prompt)


def test_router_serves_chat_through_the_mocker(
    mock: MockEngineHandle, router: RouterProcess
) -> None:
    before = served_counts(mock)
    body = chat(router.base, "hello there, mock engine")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["message"]["content"], str)
    assert choice["message"]["content"].strip()
    assert body["usage"]["completion_tokens"] == 6
    served_by(mock, before)


def test_repeated_prompt_follows_the_kv_events(
    mock: MockEngineHandle, router: RouterProcess
) -> None:
    # Which rank does the router pick for a prompt nobody has seen?
    probe = long_message("probe")
    before = served_counts(mock)
    chat(router.base, probe)
    default_rank = served_by(mock, before)
    sent = mock.recent_prompts(default_rank)[-1][1]
    assert sent == render_prompt(probe), "the rendering below must match the router's"

    # Warm a fresh long prompt on the *other* rank, bypassing the router.
    target = 1 - default_rank
    content = long_message("warm")
    prompt = render_prompt(content)
    assert len(prompt) >= 8 * BLOCK
    published = mock.stats(target).kv_batches_published
    pin(mock, target, prompt)
    assert mock.stats(target).kv_batches_published > published
    published = mock.stats(target).kv_batches_published
    wait_until(
        lambda: router.applied(target) >= published,
        10,
        lambda: f"vllm-router applied {router.applied(target)} of {published} batches",
    )

    for _ in range(3):
        cached = mock.stats(target).cached_tokens
        before = served_counts(mock)
        chat(router.base, content)
        assert served_by(mock, before) == target
        hit = mock.stats(target).cached_tokens - cached
        assert hit >= (len(prompt) - 1) // BLOCK * BLOCK - BLOCK
