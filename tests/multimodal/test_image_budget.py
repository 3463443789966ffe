"""The token budget checked from image headers, before any pixel is decoded.

Through HTTP against the mock engine with a Qwen2-VL token formula: images whose headers
show they cannot fit the context are refused as a context-length error without being decoded
(a PNG that only claims its size would be refused as corrupt if it were decoded), cheaply, and
nothing reaches the engine; images that fit are served.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from PIL import Image

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.multimodal.errors import MediaError, MediaOverBudget
from rankgate.multimodal.types import MediaRef
from tests.app.serving import serve_app
from tests.multimodal.pictures import data_uri, encode, noise, png_claiming
from tests.support.engines import EngineUnderTest
from tests.support.loop_probe import health_probe


@pytest.fixture(scope="module")
def gateway(mock_vllm: EngineUnderTest) -> Iterator[httpx.Client]:
    preparer = MediaPreparer(MediaConfig(token_family="qwen2_vl"))
    settings = GatewaySettings(engine=mock_vllm.target, tokenizer=str(mock_vllm.tokenizer_dir))
    with (
        serve_app(create_app(settings, media=preparer)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client


def chat(client: httpx.Client, uris: list[str], **fields: Any) -> httpx.Response:
    content: list[dict[str, Any]] = [{"type": "text", "text": "which is bluer?"}]
    content += [{"type": "image_url", "image_url": {"url": uri}} for uri in uris]
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": content}]}
    return client.post("/v1/chat/completions", json={"max_tokens": 1, **body, **fields})


def solid_png(width: int, height: int, shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 0, 0)).save(buffer, "PNG", compress_level=1)
    return buffer.getvalue()


def received(engine: EngineUnderTest) -> int:
    return sum(engine.mock.stats(rank).requests_received for rank in range(engine.dp_size))


def test_images_past_the_budget_are_refused_from_their_headers(
    gateway: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    before = received(mock_vllm)
    # 2000x2000 is 5102 Qwen tokens per image, far past the mock's 512-token context; the
    # claimed size is all there is: decoding would refuse these PNGs as corrupt.
    response = chat(gateway, [data_uri(png_claiming(2000, 2000))] * 3)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert "input tokens" in error["message"]
    assert received(mock_vllm) == before


def test_many_large_images_cost_neither_time_nor_memory(
    gateway: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    """Issue 18: decoding many big images before the context check cost seconds and
    hundreds of MB; counted from their headers they are refused at once."""
    uris = [data_uri(solid_png(4000, 3000, shade)) for shade in range(8)]
    url = str(gateway.base_url).rstrip("/")
    with health_probe(url) as probe:
        response = chat(gateway, uris)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert probe.max_latency < 1.0


def test_images_that_fit_are_decoded_and_served(gateway: httpx.Client) -> None:
    small = data_uri(encode(noise(56, 56, seed=5), "PNG"))
    response = chat(gateway, [small, small])
    assert response.status_code == 200, response.text


def test_the_tokens_asked_for_count_against_the_images(gateway: httpx.Client) -> None:
    # 224x224 is 64 Qwen tokens; with 480 tokens to generate it no longer fits in 512.
    picture = data_uri(encode(noise(224, 224, seed=6), "PNG"))
    assert chat(gateway, [picture], max_tokens=64).status_code == 200
    refused = chat(gateway, [picture], max_tokens=480)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"


async def test_a_corrupt_image_before_one_that_fails_to_load_is_the_refusal() -> None:
    preparer = MediaPreparer(MediaConfig(token_family="qwen2_vl"))
    try:
        with pytest.raises(MediaError) as caught:
            await preparer.prepare(
                [MediaRef(data_uri(png_claiming(64, 64))), MediaRef("data:image/png;base64,@@")],
                token_budget=10_000,
            )
        assert caught.value.index == 0
        assert not isinstance(caught.value, MediaOverBudget)
    finally:
        await preparer.aclose()
