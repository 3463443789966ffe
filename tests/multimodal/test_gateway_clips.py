"""Audio and video end to end: HTTP chat request → gateway → mock vLLM, checked on the engine.

The mock engine expands an audio placeholder into ceil(seconds * 12.5) tokens and a video
placeholder into ceil(min(frames, 16) / 2) tiles of 28 px per frame, folds each MediaItem's
uuid into the blocks holding it and names the uuid in its KV events: so the events show which
ids reached the engine, and its per-rank ``cached_tokens`` counter shows prefix-cache hits.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.multimodal.identity import content_identity
from tests.app.serving import serve_app
from tests.conformance.helpers import kv_listener
from tests.multimodal.clips import encoded_audio, video, wav
from tests.multimodal.pictures import data_uri, encode, noise
from tests.multimodal.test_gateway_images import ImageServer, mock_tokens
from tests.support.engines import EngineUnderTest

AUDIO_TOKEN, VIDEO_TOKEN = 3072, 3073  # <|audio|> and <|video|> in the tiny tokenizer
RANK = 0
QUESTION = "What is said in this clip?"


def audio_tokens(seconds: float) -> int:
    return math.ceil(seconds * 12.5)


def video_tokens(frames: int, width: int, height: int) -> int:
    return math.ceil(min(frames, 16) / 2) * math.ceil(width / 28) * math.ceil(height / 28)


@pytest.fixture(scope="module")
def media_server() -> Iterator[ImageServer]:
    server = ImageServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def preparer() -> MediaPreparer:
    return MediaPreparer(MediaConfig(allowed_networks=("127.0.0.0/8",), max_audios=3))


@pytest.fixture(scope="module")
def gateway(mock_vllm: EngineUnderTest, preparer: MediaPreparer) -> Iterator[httpx.Client]:
    settings = GatewaySettings(engine=mock_vllm.target, tokenizer=str(mock_vllm.tokenizer_dir))
    with (
        serve_app(create_app(settings, media=preparer)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client


def input_audio(data: bytes, fmt: str = "wav", **part: Any) -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": encoded, "format": fmt}, **part}


def audio_url(url: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


def video_url(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(client: httpx.Client, parts: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}],
        "max_tokens": 1,
        "temperature": 0,
        **fields,
    }
    return client.post(
        "/v1/chat/completions", json=body, headers={"x-data-parallel-rank": str(RANK)}
    )


def cached_tokens(engine: EngineUnderTest) -> int:
    engine.mock.wait_idle()
    return int(engine.mock.stats(RANK).cached_tokens)


def named(found: list[Any]) -> set[str]:
    """The media ids the engine's KV events name."""
    keys: set[str] = set()
    for event in found:
        if event.kind == "BlockStored" and event.extra_keys:
            for block_keys in event.extra_keys:
                keys.update(
                    k[0] if isinstance(k, list) else k
                    for k in block_keys or ()
                    if isinstance(k, (str, list))
                )
    return keys


def test_an_audio_clip_sent_as_data_or_url_reaches_the_engine_under_one_id_and_hits_its_cache(
    gateway: httpx.Client, media_server: ImageServer, mock_vllm: EngineUnderTest
) -> None:
    clip = wav(2.0, tone=330.0)
    clip_id = content_identity(clip)
    text = chat(gateway, [])
    assert text.status_code == 200, text.text
    text_tokens = text.json()["usage"]["prompt_tokens"]

    with kv_listener(mock_vllm) as events:
        first = chat(gateway, [input_audio(clip)])
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] == text_tokens + audio_tokens(2.0)
        seen = events.wait_for(lambda found: clip_id in named(found))
    stored = [e for e in seen if e.kind == "BlockStored" and AUDIO_TOKEN in e.token_ids]
    assert stored, "the audio's blocks hold its placeholder token"

    # The same bytes from a URL: the same id, so the engine's cache holds every block.
    url = media_server.put("/clip.wav", clip, "audio/wav")
    before = cached_tokens(mock_vllm)
    again = chat(gateway, [audio_url(url)])
    assert again.status_code == 200, again.text
    prompt_tokens = again.json()["usage"]["prompt_tokens"]
    hit = cached_tokens(mock_vllm) - before
    block = mock_vllm.block_size
    assert hit >= (prompt_tokens - 1) // block * block - block
    assert hit >= text_tokens - block + audio_tokens(2.0)

    # Another clip of the same length is other bytes, so another id: its blocks miss.
    other = wav(2.0, tone=550.0)
    assert content_identity(other) != clip_id
    before = cached_tokens(mock_vllm)
    response = chat(gateway, [input_audio(other)])
    assert response.status_code == 200, response.text
    assert cached_tokens(mock_vllm) - before <= text_tokens


def test_compressed_audio_formats_are_measured_and_sent(gateway: httpx.Client) -> None:
    for container, codec, fmt in (
        ("flac", "flac", "flac"),
        ("mp3", "libmp3lame", "mp3"),
        ("ogg", "libopus", "ogg"),
    ):
        rate = 48_000 if codec == "libopus" else 16_000
        clip = encoded_audio(container, codec, seconds=1.0, rate=rate, tone=260.0)
        response = chat(gateway, [input_audio(clip, fmt)])
        assert response.status_code == 200, (container, response.text)


def test_a_video_is_expanded_learnt_and_routed_on_its_blocks_when_sent_again(
    gateway: httpx.Client, preparer: MediaPreparer, mock_vllm: EngineUnderTest
) -> None:
    clip = video(frames=8, width=64, height=48, shade=17)
    clip_id = content_identity(clip)
    text_tokens = chat(gateway, []).json()["usage"]["prompt_tokens"]
    first = chat(gateway, [video_url(uri(clip, "video/mp4"))])
    assert first.status_code == 200, first.text
    expected = video_tokens(8, 64, 48)
    assert first.json()["usage"]["prompt_tokens"] == text_tokens + expected
    assert first.headers["x-rankgate-route"].endswith(";prompt=estimated")
    assert preparer.learned.get(clip_id) == expected

    before = cached_tokens(mock_vllm)
    again = chat(gateway, [video_url(uri(clip, "video/mp4"))])
    route = again.headers["x-rankgate-route"]
    assert "estimated" not in route
    total = int(route.split("cached=")[1].split(";")[0].split("/")[1])
    assert total == again.json()["usage"]["prompt_tokens"]
    assert cached_tokens(mock_vllm) - before >= expected

    # A new video of the same shape (size, frames, span) is counted exactly at once.
    same_shape = video(frames=8, width=64, height=48, shade=99)
    response = chat(gateway, [video_url(uri(same_shape, "video/mp4"))])
    assert "estimated" not in response.headers["x-rankgate-route"]


def test_images_audio_and_video_in_one_message_keep_their_order(
    gateway: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    picture = encode(noise(56, 56, seed=71), "PNG")
    clip = wav(1.0, tone=700.0)
    film = video("webm", "libvpx", frames=4, width=56, height=56, shade=5)
    parts = [
        {"type": "image_url", "image_url": {"url": data_uri(picture)}},
        input_audio(clip),
        video_url(uri(film, "video/webm")),
    ]
    text_tokens = chat(gateway, []).json()["usage"]["prompt_tokens"]
    with kv_listener(mock_vllm) as events:
        response = chat(gateway, parts)
        assert response.status_code == 200, response.text
        ids = {content_identity(picture), content_identity(clip), content_identity(film)}
        events.wait_for(lambda found: ids <= named(found))
    assert response.json()["usage"]["prompt_tokens"] == (
        text_tokens + mock_tokens(56, 56) + audio_tokens(1.0) + video_tokens(4, 56, 56)
    )


def test_a_clients_uuid_names_the_clip(gateway: httpx.Client, mock_vllm: EngineUnderTest) -> None:
    with kv_listener(mock_vllm) as events:
        response = chat(gateway, [input_audio(wav(1.0, tone=900.0), uuid="meeting-clip-7")])
        assert response.status_code == 200, response.text
        events.wait_for(lambda found: "meeting-clip-7" in named(found))


@pytest.mark.parametrize(
    ("part", "message", "code"),
    [
        (
            input_audio(b"RIFF\x00\x00\x00\x00WAVEfmt "),
            "audio 0: corrupt or truncated wav audio",
            "invalid_audio",
        ),
        (
            input_audio(b"not audio at all" * 8),
            "audio 0: unrecognised audio data",
            "invalid_audio",
        ),
        (
            audio_url(uri(video(), "video/mp4")),
            "audio 0: data URI media type video/mp4 is not an audio",
            "invalid_audio",
        ),
        (
            input_audio(video()),
            "audio 0: the mp4 data has no audio stream",
            "invalid_audio",
        ),
        (
            video_url(uri(wav(), "video/wav")),
            "video 0: video container wav is not allowed",
            "invalid_video",
        ),
        (
            video_url("http://169.254.169.254/latest/meta-data/"),
            "video 0: 169.254.169.254, a link-local address; fetching it is not allowed",
            "invalid_video",
        ),
        (
            # Cut before the index FFmpeg writes last: no stream to read.
            video_url(uri(video()[:600], "video/mp4")),
            "video 0: the mp4 data has no video stream",
            "invalid_video",
        ),
    ],
)
def test_refused_clips_get_a_400_naming_the_clip(
    gateway: httpx.Client, part: dict[str, Any], message: str, code: str
) -> None:
    response = chat(gateway, [part])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(message), error["message"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "messages",
        code,
    )


def test_too_many_audio_clips_are_refused_before_any_is_decoded(gateway: httpx.Client) -> None:
    clip = wav(0.5)
    response = chat(gateway, [input_audio(clip)] * 4)
    assert response.status_code == 400, response.text
    assert "too many audio clips: the request has 4, at most 3 allowed" in response.text


def test_an_input_audio_format_is_checked_as_a_field(gateway: httpx.Client) -> None:
    part = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav;base64,"}}
    response = chat(gateway, [part])
    assert response.status_code == 400, response.text
    assert "format" in response.json()["error"]["param"]


@pytest.mark.parametrize("field", ["media_io_kwargs", "mm_processor_kwargs"])
def test_per_request_media_settings_are_refused_unless_empty(
    gateway: httpx.Client, field: str
) -> None:
    clip = input_audio(wav(0.5))
    assert chat(gateway, [clip], **{field: {}}).status_code == 200
    refused = chat(gateway, [clip], **{field: {"video": {"num_frames": 8}}})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == field


def test_the_responses_api_takes_input_audio(gateway: httpx.Client) -> None:
    clip = wav(2.0, tone=1200.0)
    part = input_audio(clip)
    text = {"type": "input_text", "text": QUESTION}
    payload = {
        "model": "tiny-llama",
        "input": [{"role": "user", "content": [text]}],
        "max_output_tokens": 1,
        "temperature": 0,
    }
    plain = gateway.post("/v1/responses", json=payload)
    assert plain.status_code == 200, plain.text
    payload["input"] = [{"role": "user", "content": [text, part]}]
    response = gateway.post("/v1/responses", json=payload)
    assert response.status_code == 200, response.text
    tokens = response.json()["usage"]["input_tokens"] - plain.json()["usage"]["input_tokens"]
    assert tokens == audio_tokens(2.0)
