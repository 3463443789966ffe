"""Video through the gateway on real vLLM: a tiny Qwen3-VL, DP=2.

vLLM 0.32's Rust frontend decodes the video (with ffprobe and ffmpeg), samples its frames and
preprocesses them itself; the gateway sends the bytes. Checked here as for audio: the learnt
count is vLLM's, a repeated video goes to the rank that cached it and vLLM's prefix-cache
counters confirm the hit, two videos never share a key, the context check counts the
expansion, and vLLM's own HTTP server names the video as the gateway does.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.multimodal.identity import content_identity
from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc
from tests.app.serving import serve_app
from tests.conformance.helpers import kv_listener
from tests.multimodal.clips import video
from tests.multimodal.test_gateway_images import ImageServer
from tests.multimodal.test_real_vllm_audio import (
    body,
    media_keys,
    post,
    prefix_hits,
    route,
    settle,
    unique_text,
)
from tests.support.engines import EngineUnderTest
from tests.support.real_vllm import RealVllm

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

VIDEO_TOKEN_ID = 3073  # "<|video_pad|>" in the tiny Qwen3-VL's tokenizer
MARKERS = 2  # the vision start and end tokens the template writes around a video
VISION_START, VISION_END = 0, 2  # "<|bos|>" and "<|pad|>" stand in for them


def video_url(data: bytes, mime: str = "video/mp4") -> dict[str, Any]:
    uri = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "video_url", "video_url": {"url": uri}}


@pytest.fixture(scope="module")
def vl(real_vl: RealVllm) -> EngineUnderTest:
    return EngineUnderTest(
        kind="real",
        target=real_vl.target,
        dp_size=real_vl.dp_size,
        block_size=real_vl.block_size,
        served_model_name=real_vl.served_model_name,
        tokenizer_dir=real_vl.model_dir,
        kv_events_base_port=real_vl.kv_events_base_port,
        kv_replay_base_port=real_vl.kv_replay_base_port,
    )


@pytest.fixture(scope="module")
def preparer() -> MediaPreparer:
    return MediaPreparer(MediaConfig(allowed_networks=("127.0.0.0/8",)))


@pytest.fixture(scope="module")
def gateway(real_vl: RealVllm, preparer: MediaPreparer) -> Iterator[httpx.Client]:
    settings = GatewaySettings(
        engine=real_vl.target, tokenizer=str(real_vl.model_dir), startup_timeout=180.0
    )
    with (
        serve_app(create_app(settings, media=preparer)) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def media_server() -> Iterator[ImageServer]:
    server = ImageServer()
    yield server
    server.close()


def test_a_repeated_video_is_routed_to_the_rank_vllm_cached_it_on(
    gateway: httpx.Client,
    vl: EngineUnderTest,
    real_vl: RealVllm,
    preparer: MediaPreparer,
    media_server: ImageServer,
) -> None:
    model = real_vl.served_model_name
    clip = video(frames=8, width=64, height=48, fps=4, shade=11)
    uuid = content_identity(clip)
    text = unique_text()
    text_only = post(gateway, body(model, text)).json()["usage"]["prompt_tokens"]

    with kv_listener(vl) as events:
        first = post(gateway, body(model, text, video_url(clip)))
        seen = events.wait_for(lambda found: uuid in media_keys(found))
    # The template writes the video's start and end markers around its placeholder.
    tokens = first.json()["usage"]["prompt_tokens"] - text_only - MARKERS
    assert tokens > 1
    rank, _, _, estimated = route(first)
    assert estimated
    assert preparer.learned.get(uuid) == tokens
    assert {publisher for publisher, _ in media_keys(seen)[uuid]} == {rank}
    settle(gateway, events)

    url = media_server.put("/again.mp4", clip, "video/mp4")
    before = prefix_hits(real_vl)
    again = post(gateway, body(model, text, {"type": "video_url", "video_url": {"url": url}}))
    after = prefix_hits(real_vl)
    again_rank, cached, prompt, estimated = route(again)
    assert (again_rank, prompt, estimated) == (rank, text_only + MARKERS + tokens, False)
    assert prompt == again.json()["usage"]["prompt_tokens"]
    assert cached >= tokens
    assert after[rank] - before.get(rank, 0.0) >= cached


def test_the_learned_count_is_vllms_prompt_info_count(
    gateway: httpx.Client, real_vl: RealVllm, preparer: MediaPreparer
) -> None:
    clip = video("webm", "libvpx", frames=6, width=80, height=60, fps=3, shade=23)
    post(gateway, body(real_vl.served_model_name, unique_text(), video_url(clip, "video/webm")))
    # Qwen3-VL needs the markers around the placeholder (without them vLLM 0.32's engine core
    # fails, and stays down).
    ids = [40, 41, VISION_START, VIDEO_TOKEN_ID, VISION_END, 42]
    request = inference_pb2.GenerateRequest(
        request_id=f"learned-{time.monotonic_ns()}",
        token_ids=inference_pb2.TokenIds(ids=ids),
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=1),
    )
    request.media.add(
        modality=inference_pb2.MODALITY_VIDEO,
        raw_bytes=clip,
        mime_type="video/webm",
        uuid=content_identity(clip),
    )
    with grpc.insecure_channel(real_vl.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        first = next(stub.GenerateStream(request, timeout=60))
    expanded = first.prompt_info.num_prompt_tokens - (len(ids) - 1)
    assert preparer.learned.get(content_identity(clip)) == expanded


def test_two_different_videos_never_share_a_key(
    gateway: httpx.Client, vl: EngineUnderTest, real_vl: RealVllm
) -> None:
    model = real_vl.served_model_name
    text = unique_text()
    text_only = post(gateway, body(model, text)).json()["usage"]["prompt_tokens"]
    one = video(frames=8, width=64, height=48, fps=4, shade=31)
    other = video(frames=8, width=64, height=48, fps=4, shade=32)
    with kv_listener(vl) as events:
        post(gateway, body(model, text, video_url(one)))
        events.wait_for(lambda found: content_identity(one) in media_keys(found))
        settle(gateway, events)
        before = prefix_hits(real_vl)
        second = post(gateway, body(model, text, video_url(other)))
        events.wait_for(lambda found: content_identity(other) in media_keys(found))
    after = prefix_hits(real_vl)
    assert content_identity(one) != content_identity(other)
    # Only the text before the video can be shared; the router and vLLM agree on that.
    shareable = text_only // real_vl.block_size * real_vl.block_size
    _, cached, _, _ = route(second)
    assert cached <= shareable
    assert sum(after.values()) - sum(before.values()) <= shareable


def test_the_context_check_counts_an_expanded_video(
    gateway: httpx.Client, real_vl: RealVllm
) -> None:
    model = real_vl.served_model_name
    text = unique_text(8)
    clip = video(frames=8, width=64, height=48, fps=4, shade=41)
    expanded = post(gateway, body(model, text, video_url(clip))).json()["usage"]["prompt_tokens"]
    too_many = real_vl.max_model_len - expanded + 1
    refused = gateway.post(
        "/v1/chat/completions", json=body(model, text, video_url(clip), max_tokens=too_many)
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"


def test_vllms_own_server_names_a_video_as_the_gateway_does(
    gateway: httpx.Client, vl: EngineUnderTest, real_vl: RealVllm
) -> None:
    model = real_vl.served_model_name
    clip = video(frames=8, width=64, height=48, fps=4, shade=51)
    payload = body(model, unique_text(), video_url(clip))
    with kv_listener(vl) as events:
        direct = httpx.post(f"{real_vl.http_url}/v1/chat/completions", json=payload, timeout=60)
        assert direct.status_code == 200, direct.text
        seen = events.wait_for(lambda found: bool(media_keys(found)))
    assert set(media_keys(seen)) == {content_identity(clip)}
    holder = {rank for rank, _ in media_keys(seen)[content_identity(clip)]}
    settle(gateway, events)
    # A video of this shape was seen before: the gateway knows its exact expansion (frame
    # timestamps and markers among the frames), so its blocks match what vLLM stored.
    before = prefix_hits(real_vl)
    through = post(gateway, payload)
    after = prefix_hits(real_vl)
    rank, cached, prompt, estimated = route(through)
    assert {rank} == holder
    assert not estimated
    assert prompt == through.json()["usage"]["prompt_tokens"]
    assert cached >= (prompt - 32) // 32 * 32
    assert after[rank] - before.get(rank, 0.0) >= cached
