"""``--policy kv`` through ``rankgate serve``'s own flags, driven over HTTP against the mocker
(DP=2, KV events on, timing slowed so requests overlap).

* Conversations whose only difference is the picture they show land on the rank that cached
  that picture: the gateway places each image (``MediaInput.position``) and the router folds
  its identity into the blocks it fills, exactly as vLLM's KV events report them.
* A routing tunable given as a flag (``--route-hot-spill-requests``) changes decisions, and the
  decisions, the KV-event intake and the index sizes show on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.app.test_route_header import route_of, served_on
from tests.conftest import TINY_TOKENIZER
from tests.multimodal.pictures import data_uri, encode, noise
from tests.support.engines import EngineUnderTest
from tests.support.metrics import metric_total
from tests.support.mock_engine import MockEngineHandle, kv_mock_config, running_mock_engine
from tests.support.polling import wait_until

MODEL = "routing-llm"
DP = 2
BLOCK = 16
# Prefill 300 tokens in ~75 ms, decode a token every ~40 ms.
SPEED = 0.2
SYSTEM = "You compare pictures for a living and answer in one word. " * 4


class Rig:
    def __init__(self, handle: MockEngineHandle, http: httpx.Client, url: str) -> None:
        self.handle = handle
        self.http = http
        self.url = url
        self.engine = EngineUnderTest(
            kind="mock",
            target=handle.target,
            dp_size=DP,
            block_size=BLOCK,
            served_model_name=MODEL,
            tokenizer_dir=TINY_TOKENIZER,
            kv_events_base_port=None,
            kv_replay_base_port=None,
            mock=handle,
        )

    def metric(self, name: str, **labels: str) -> float:
        return metric_total(self.http, name, **labels)

    def wait_metric(self, name: str, at_least: float, within: float = 10.0, **labels: str) -> None:
        wait_until(
            lambda: self.metric(name, **labels) >= at_least,
            within,
            lambda: f"{name}{labels} at {self.metric(name, **labels)}, below {at_least}",
        )


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    config = kv_mock_config(MODEL, dp_size=DP, block_size=BLOCK, speed=SPEED)
    with running_mock_engine(config) as handle:
        argv = [
            "serve",
            "--engine",
            handle.target,
            "--tokenizer",
            str(TINY_TOKENIZER),
            "--startup-timeout",
            "30",
            "--route-hot-spill-requests",
            "1",
            "--kv-burst",
            "64",
        ]
        settings = settings_from_args(build_parser().parse_args(argv))
        assert settings.policy == "kv"
        with (
            serve_app(create_app(settings)) as url,
            httpx.Client(base_url=url, timeout=60) as http,
        ):
            yield Rig(handle, http, url)


def image_chat(rig: Rig, picture: str, rid: str, rank: int | None = None, turns: int = 1) -> Any:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": "The first one."})
        content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": picture}}]
        content.append({"type": "text", "text": f"Question {turn}: is it mostly blue?"})
        messages.append({"role": "user", "content": content})
    headers = {} if rank is None else {"x-data-parallel-rank": str(rank)}
    response = rig.http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "request_id": rid,
        },
        headers=headers,
    )
    assert response.status_code == 200, response.text
    return response


def test_image_conversations_return_to_the_rank_that_cached_their_image(rig: Rig) -> None:
    # Same size (so the same token ids once expanded), different pixels: only the images'
    # identities tell the two conversations apart.
    pictures = [data_uri(encode(noise(280, 280, seed=seed), "PNG")) for seed in (71, 72)]
    for rank, picture in enumerate(pictures):
        rid = f"img-pin-{rank}-{os.urandom(3).hex()}"
        image_chat(rig, picture, rid, rank=rank)
        assert served_on(rig.engine, rid) == rank
    rig.handle.wait_idle()
    # Both ranks' events (system prompt, image blocks) are in the gateway's index.
    for rank in range(DP):
        rig.wait_metric(
            "rankgate_routing_index_blocks", 2 * 100 // BLOCK, rank=str(rank), medium="device"
        )

    for turns in (1, 2):
        for rank, picture in enumerate(pictures):
            before = rig.handle.stats(rank).cached_tokens
            rid = f"img-again-{rank}-{turns}-{os.urandom(3).hex()}"
            response = image_chat(rig, picture, rid, turns=turns)
            route = route_of(response)
            assert served_on(rig.engine, rid) == rank, route
            assert (route["rank"], route["reason"]) == (str(rank), "best"), route
            prompt_tokens = response.json()["usage"]["prompt_tokens"]
            assert int(route["prompt"]) == prompt_tokens
            # The router expected the image's blocks there, and the engine hit them.
            assert int(route["cached"]) >= 100
            rig.handle.wait_idle()
            hit = rig.handle.stats(rank).cached_tokens - before
            assert hit >= int(route["cached"]) - BLOCK, (hit, route)

    # A picture no rank has seen: nothing past the shared system prompt counts as cached.
    fresh = data_uri(encode(noise(280, 280, seed=73), "PNG"))
    route = route_of(image_chat(rig, fresh, f"img-fresh-{os.urandom(3).hex()}"))
    assert int(route["cached"]) < 100


async def _last_line(lines: AsyncIterator[str]) -> str:
    last = ""
    async for line in lines:
        if line:
            last = line
    return last


async def test_the_hot_spill_flag_moves_the_third_concurrent_request_off_a_hot_rank(
    rig: Rig,
) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(100, 3000) for _ in range(300)]
    spills_before = rig.metric("rankgate_routing_spills_total", reason="hot_prefix")
    body = {
        "model": MODEL,
        "prompt": prompt,
        # ~5 s of decoding: every stream is still running when the third one is routed.
        "max_tokens": 120,
        "min_tokens": 120,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    routes: list[dict[str, str]] = []
    async with httpx.AsyncClient(base_url=rig.url, timeout=60) as http:
        streams = []
        readers: list[AsyncIterator[str]] = []
        try:
            for _ in range(3):
                stream = http.stream("POST", "/v1/completions", json=body)
                response = await stream.__aenter__()
                streams.append(stream)
                assert response.status_code == 200
                routes.append(route_of(response))
                lines = response.aiter_lines()
                readers.append(lines)
                # Wait for the first token: the prompt is prefilled, the request decodes on.
                while not (await anext(lines)).startswith("data: {"):
                    pass
            ends = await asyncio.gather(*(_last_line(lines) for lines in readers))
            assert ends == ["data: [DONE]"] * 3
        finally:
            for stream in streams:
                await stream.__aexit__(None, None, None)
    first, second, third = routes
    assert second["rank"] == first["rank"], [sorted(route.items()) for route in routes]
    assert int(second["cached"]) > 0
    assert (third["rank"], third["reason"]) == (str(1 - int(first["rank"])), "spill_hot"), [
        sorted(route.items()) for route in routes
    ]
    assert rig.metric("rankgate_routing_spills_total", reason="hot_prefix") == spills_before + 1
    await asyncio.to_thread(rig.handle.wait_idle)
    routed = sum(
        rig.metric("rankgate_routing_requests_total", policy="kv", rank=str(rank))
        for rank in range(DP)
    )
    assert routed >= 3
    assert rig.metric("rankgate_kv_event_batches_total", origin="live") > 0
