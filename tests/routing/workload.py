"""The routing workloads against the mock engine (DP=4, GPU-like timing), shared by the
end-to-end test and ``bench/routing_workload.py``.

* ``SharedPrefix``: conversations that share a system prompt, several turns each; every turn's
  prompt is the previous prompt, the model's answer and a new user message (token ids end to
  end), with random pauses between turns.
* ``NoReuse``: one-turn requests with nothing in common, arriving at a steady rate.

Each run starts a fresh engine and a Sidecar with the policy under test. The hit rate is the
engine's own count (cached prompt tokens / prompt tokens over all ranks); TTFT is measured at
the client, from sending the request to the first token.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import httpx
import msgspec
from prometheus_client import CollectorRegistry

from rankgate.mocker.config import MockEngineConfig
from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.types import PreparedRequest, SamplingParams, StoppingParams
from tests.support.mock_engine import running_mock_engine
from tests.support.ports import free_port, free_port_range

# The tiny tokenizer the gateway and the engine share has 3,072 ids.
TOKENIZER = (
    Path(__file__).resolve().parents[2] / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
)
VOCAB = (100, 3000)
Via = Literal["sidecar", "gateway"]


@dataclass(frozen=True)
class SharedPrefix:
    """Multi-turn conversations; ``groups`` distinct system prompts are shared among them."""

    conversations: int = 8
    turns: int = 6
    groups: int = 2
    system_tokens: int = 256
    user_tokens: int = 192
    output_tokens: int = 8
    # Mean of the exponentially distributed pause between a reply and the next turn.
    think_seconds: float = 0.5
    stagger_seconds: float = 0.05
    # Small enough that one rank cannot keep every conversation's history.
    kv_blocks_per_rank: int = 256
    seed: int = 7
    name: str = "shared"


@dataclass(frozen=True)
class NoReuse:
    requests: int = 64
    min_tokens: int = 256
    max_tokens: int = 1024
    output_tokens: int = 8
    interval_seconds: float = 0.1
    kv_blocks_per_rank: int = 1024
    seed: int = 11
    name: str = "unique"


Workload = SharedPrefix | NoReuse


@dataclass
class PolicyResult:
    policy: str
    workload: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    seconds: float = 0.0
    per_rank: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttfts) if self.ttfts else 0.0

    @property
    def p99_ttft(self) -> float:
        if not self.ttfts:
            return 0.0
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def engine_config(speed: float, kv_blocks_per_rank: int, dp: int = 4) -> MockEngineConfig:
    return MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=dp,
        block_size=16,
        model="bench-llm",
        tokenizer=str(TOKENIZER),
        total_kv_blocks=kv_blocks_per_rank * dp,
        # What a rank holds besides vLLM's null block.
        max_model_len=min(4096, (kv_blocks_per_rank - 1) * 16),
        max_running_requests=64,
        kv_events_port=free_port_range(dp),
        kv_replay_port=free_port_range(dp),
        speed=speed,
        eos_probability=0.0,
    )


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(count)]


class Client(Protocol):
    async def complete(
        self, request_id: str, prompt: Sequence[int], out: int
    ) -> tuple[float, list[int]]:
        """Generate ``out`` tokens; returns (seconds to the first token, output token ids)."""
        ...


class SidecarClient:
    """Straight into the Sidecar facade: token ids in, token ids out."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    async def complete(
        self, request_id: str, prompt: Sequence[int], out: int
    ) -> tuple[float, list[int]]:
        request = PreparedRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt),
            sampling=SamplingParams(temperature=0.0),
            stopping=StoppingParams(max_tokens=out, min_tokens=out, ignore_eos=True),
        )
        started = time.perf_counter()
        first = 0.0
        output: list[int] = []
        async for delta in self._sidecar.generate(request):
            if delta.token_ids:
                if not first:
                    first = time.perf_counter() - started
                output.extend(delta.token_ids)
        return first, output


class GatewayClient:
    """Through the gateway's HTTP API: a streamed ``/v1/completions`` with a token-id prompt.

    The answer comes back as text, so the next turn carries the user's tokens only: the
    history the engine cached is still the prefix of every later prompt.
    """

    def __init__(self, http: httpx.AsyncClient, model: str) -> None:
        self._http = http
        self._model = model

    async def complete(
        self, request_id: str, prompt: Sequence[int], out: int
    ) -> tuple[float, list[int]]:
        body = {
            "model": self._model,
            "prompt": list(prompt),
            "max_tokens": out,
            "min_tokens": out,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        started = time.perf_counter()
        first = 0.0
        async with self._http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and not first:
                    first = time.perf_counter() - started
        return first, []


async def _shared(client: Client, work: SharedPrefix, result: PolicyResult) -> None:
    rng = random.Random(work.seed)
    systems = [_tokens(rng, work.system_tokens) for _ in range(work.groups)]
    users = [
        [_tokens(rng, work.user_tokens) for _ in range(work.turns)]
        for _ in range(work.conversations)
    ]

    pauses = [
        [rng.expovariate(1 / work.think_seconds) for _ in range(work.turns)]
        for _ in range(work.conversations)
    ]

    async def conversation(index: int) -> None:
        await asyncio.sleep(index * work.stagger_seconds)
        prompt = [*systems[index % work.groups], *users[index][0]]
        for turn in range(work.turns):
            ttft, output = await client.complete(f"c{index}t{turn}", prompt, work.output_tokens)
            result.ttfts.append(ttft)
            if turn + 1 < work.turns:
                prompt = [*prompt, *output, *users[index][turn + 1]]
                await asyncio.sleep(pauses[index][turn])

    await asyncio.gather(*(conversation(i) for i in range(work.conversations)))


async def _unique(client: Client, work: NoReuse, result: PolicyResult) -> None:
    rng = random.Random(work.seed)
    prompts = [
        _tokens(rng, rng.randrange(work.min_tokens, work.max_tokens)) for _ in range(work.requests)
    ]

    async def one(index: int) -> None:
        await asyncio.sleep(index * work.interval_seconds)
        ttft, _ = await client.complete(f"u{index}", prompts[index], work.output_tokens)
        result.ttfts.append(ttft)

    await asyncio.gather(*(one(i) for i in range(work.requests)))


async def run_policy(
    policy: str,
    work: Workload,
    speed: float = 1.0,
    routing: RoutingConfig | None = None,
    via: Via = "sidecar",
) -> PolicyResult:
    """One workload under one policy on a fresh mock engine; returns the engine's counts.

    ``via="gateway"`` serves the whole gateway (HTTP, OpenAI schema, tokenizer) on loopback and
    drives it over HTTP; ``"sidecar"`` calls the Sidecar facade directly.
    """
    config = engine_config(speed, work.kv_blocks_per_rank)
    result = PolicyResult(policy=policy, workload=work.name)
    settings = msgspec.structs.replace(routing or RoutingConfig(), policy=policy)
    with running_mock_engine(config) as handle:
        async with _client(handle.target, config.model, settings, via) as client:
            started = time.perf_counter()
            if isinstance(work, SharedPrefix):
                await _shared(client, work, result)
            else:
                await _unique(client, work, result)
            result.seconds = time.perf_counter() - started
        stats = await asyncio.to_thread(handle.all_stats)
    for rank, rank_stats in stats.items():
        result.prompt_tokens += rank_stats.prompt_tokens
        result.cached_tokens += rank_stats.cached_tokens
        result.requests += rank_stats.requests_received
        result.per_rank[rank] = rank_stats.requests_received
    return result


@asynccontextmanager
async def _client(
    target: str, model: str, routing: RoutingConfig, via: Via
) -> AsyncIterator[Client]:
    if via == "sidecar":
        router = build_router(routing, CollectorRegistry())
        sidecar = Sidecar(
            SidecarConfig(endpoint=target, startup_timeout=30.0, health_interval=5.0), router
        )
        await sidecar.start()
        try:
            yield SidecarClient(sidecar)
        finally:
            await sidecar.close()
        return
    from rankgate.app.config.settings import GatewaySettings
    from rankgate.app.server import create_app
    from tests.app.serving import serve_app

    settings = GatewaySettings(
        engine=target, tokenizer=str(TOKENIZER), policy=routing.policy, startup_timeout=30.0
    )
    with serve_app(create_app(settings)) as url:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as http:
            yield GatewayClient(http, model)


def table(results: Sequence[PolicyResult]) -> str:
    lines = [
        f"{'workload':<8} {'policy':<12} {'requests':>8} {'hit rate':>9} {'mean TTFT':>10} "
        f"{'p99 TTFT':>10} {'wall':>7}  requests per rank"
    ]
    for r in results:
        ranks = " ".join(str(r.per_rank[k]) for k in sorted(r.per_rank))
        lines.append(
            f"{r.workload:<8} {r.policy:<12} {r.requests:>8} {r.hit_rate:>9.1%} "
            f"{r.mean_ttft * 1000:>8.1f}ms {r.p99_ttft * 1000:>8.1f}ms {r.seconds:>6.1f}s  {ranks}"
        )
    return "\n".join(lines)
