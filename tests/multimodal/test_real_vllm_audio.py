"""Audio through the gateway on real vLLM: a tiny Qwen3-ASR, DP=2.

What the mock engine promises about audio, checked on the engine it imitates: the uuid the
gateway sends names the clip's blocks in vLLM's KV events, the router sends a repeated clip to
the rank holding those blocks and vLLM's own prefix-cache counters confirm the hit, the learnt
token count is vLLM's, two clips never share a key, and the context check counts the expanded
prompt. vLLM 0.32's Rust frontend decodes and preprocesses the audio itself (Qwen3-ASR is one of
the audio models it knows); the gateway sends the clip's bytes.
"""

from __future__ import annotations

import base64
import itertools
import re
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
from tests.conformance.helpers import KvEvent, KvEventListener, kv_listener
from tests.multimodal.clips import encoded_audio, wav
from tests.multimodal.pictures import encode, noise
from tests.multimodal.test_gateway_images import ImageServer
from tests.support.engines import EngineUnderTest
from tests.support.metrics import metric_total
from tests.support.polling import wait_until
from tests.support.real_vllm import RealVllm

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

AUDIO_TOKEN_ID = 3072  # "<|audio_pad|>" in the tiny Qwen3-ASR's tokenizer
_words = itertools.count()


def unique_text(words: int = 24) -> str:
    start = next(_words) * 1000 + 500_000
    return " ".join(f"w{start + i}" for i in range(words))


def qwen3_asr_tokens(seconds: float) -> int:
    """Qwen3-ASR's count for a 16 kHz clip: one feature frame per 160 samples, 13 tokens per
    100 frames, the rest through the tower's three stride-2 convolutions (vLLM's
    _get_feat_extract_output_lengths)."""
    frames = round(seconds * 16_000) // 160
    rest = frames % 100
    convolved = (((rest - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1 if rest else 0
    return convolved + frames // 100 * 13


def input_audio(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt},
    }


def body(model: str, text: str, *parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}, *parts]
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
    }
    payload.update(fields)
    return payload


def route(response: httpx.Response) -> tuple[int, int, int, bool]:
    """(rank, cached, prompt tokens, estimated) from ``x-rankgate-route``."""
    header = response.headers["x-rankgate-route"]
    found = re.match(r"rank=(\d+);cached=(\d+)/(\d+);", header)
    assert found is not None, header
    rank, cached, prompt = (int(group) for group in found.groups())
    return rank, cached, prompt, header.endswith(";prompt=estimated")


def prefix_hits(server: RealVllm) -> dict[int, float]:
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    hits: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine is not None:
                hits[int(engine.group(1))] = float(line.rsplit(" ", 1)[1])
    return hits


def media_keys(events: list[KvEvent]) -> dict[str, list[tuple[int, int]]]:
    """Per media id, the (publishing rank, offset) of every stored block that names it."""
    found: dict[str, list[tuple[int, int]]] = {}
    for event in events:
        if event.kind != "BlockStored":
            continue
        for keys in event.extra_keys or ():
            for key in keys or ():
                if isinstance(key, list) and len(key) == 2:
                    found.setdefault(key[0], []).append((event.port_rank, key[1]))
    return found


@pytest.fixture(scope="module")
def asr(real_asr: RealVllm) -> EngineUnderTest:
    return EngineUnderTest(
        kind="real",
        target=real_asr.target,
        dp_size=real_asr.dp_size,
        block_size=real_asr.block_size,
        served_model_name=real_asr.served_model_name,
        tokenizer_dir=real_asr.model_dir,
        kv_events_base_port=real_asr.kv_events_base_port,
        kv_replay_base_port=real_asr.kv_replay_base_port,
    )


@pytest.fixture(scope="module")
def preparer() -> MediaPreparer:
    return MediaPreparer(MediaConfig(allowed_networks=("127.0.0.0/8",)))


@pytest.fixture(scope="module")
def gateway(real_asr: RealVllm, preparer: MediaPreparer) -> Iterator[httpx.Client]:
    settings = GatewaySettings(
        engine=real_asr.target, tokenizer=str(real_asr.model_dir), startup_timeout=180.0
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


def post(client: httpx.Client, payload: dict[str, Any]) -> httpx.Response:
    response = client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 200, response.text
    return response


def settle(gateway: httpx.Client, events: KvEventListener, timeout: float = 30.0) -> None:
    """Wait until the gateway's KV-event intake has taken in every batch the listener saw."""
    seen = {rank: max(seqs) for rank, seqs in events.seqs.items() if seqs}

    def taken() -> dict[int, float]:
        return {
            rank: metric_total(gateway, "rankgate_kv_event_sequence", rank=str(rank))
            for rank in seen
        }

    wait_until(
        lambda: all(taken()[rank] >= seq for rank, seq in seen.items()),
        timeout,
        lambda: f"the gateway took in sequences {taken()} of {seen}",
    )


def test_a_repeated_clip_is_routed_to_the_rank_vllm_cached_it_on(
    gateway: httpx.Client,
    asr: EngineUnderTest,
    real_asr: RealVllm,
    preparer: MediaPreparer,
    media_server: ImageServer,
) -> None:
    model = real_asr.served_model_name
    clip = wav(3.0, tone=310.0)
    uuid = content_identity(clip)
    text = unique_text()
    text_only = post(gateway, body(model, text)).json()["usage"]["prompt_tokens"]

    with kv_listener(asr) as events:
        first = post(gateway, body(model, text, input_audio(clip)))
        seen = events.wait_for(lambda found: uuid in media_keys(found))
    tokens = first.json()["usage"]["prompt_tokens"] - text_only
    assert tokens == qwen3_asr_tokens(3.0)
    rank, _, _, estimated = route(first)
    assert estimated
    assert preparer.learned.get(uuid) == tokens
    assert {publisher for publisher, _ in media_keys(seen)[uuid]} == {rank}
    settle(gateway, events)

    # The same bytes from a URL: the same id, the same rank, vLLM's cache holds the clip.
    url = media_server.put("/again.wav", clip, "audio/wav")
    before = prefix_hits(real_asr)
    again = post(gateway, body(model, text, {"type": "audio_url", "audio_url": {"url": url}}))
    after = prefix_hits(real_asr)
    again_rank, cached, prompt, estimated = route(again)
    assert (again_rank, prompt, estimated) == (rank, text_only + tokens, False)
    assert prompt == again.json()["usage"]["prompt_tokens"]
    assert cached >= tokens
    assert after[rank] - before.get(rank, 0.0) >= cached


def test_the_learned_count_is_vllms_prompt_info_count(
    gateway: httpx.Client, real_asr: RealVllm, preparer: MediaPreparer
) -> None:
    clip = encoded_audio("flac", "flac", seconds=2.5, tone=415.0)
    post(gateway, body(real_asr.served_model_name, unique_text(), input_audio(clip, "flac")))
    ids = [40, 41, AUDIO_TOKEN_ID, 42]
    request = inference_pb2.GenerateRequest(
        request_id=f"learned-{time.monotonic_ns()}",
        token_ids=inference_pb2.TokenIds(ids=ids),
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=1),
    )
    request.media.add(
        modality=inference_pb2.MODALITY_AUDIO,
        raw_bytes=clip,
        mime_type="audio/flac",
        uuid=content_identity(clip),
    )
    with grpc.insecure_channel(real_asr.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        first = next(stub.GenerateStream(request, timeout=60))
    expanded = first.prompt_info.num_prompt_tokens - (len(ids) - 1)
    assert preparer.learned.get(content_identity(clip)) == expanded == qwen3_asr_tokens(2.5)


def test_two_different_clips_never_share_a_key(
    gateway: httpx.Client, asr: EngineUnderTest, real_asr: RealVllm
) -> None:
    model = real_asr.served_model_name
    text = unique_text()
    one, other = wav(2.0, tone=200.0), wav(2.0, tone=900.0)
    with kv_listener(asr) as events:
        first = post(gateway, body(model, text, input_audio(one)))
        events.wait_for(lambda found: content_identity(one) in media_keys(found))
        settle(gateway, events)
        before = prefix_hits(real_asr)
        second = post(gateway, body(model, text, input_audio(other)))
        events.wait_for(lambda found: content_identity(other) in media_keys(found))
    after = prefix_hits(real_asr)
    assert content_identity(one) != content_identity(other)
    text_blocks = (first.json()["usage"]["prompt_tokens"] - qwen3_asr_tokens(2.0)) // 32 * 32
    _, cached, _, _ = route(second)
    assert cached <= text_blocks
    assert sum(after.values()) - sum(before.values()) <= text_blocks


def test_the_context_check_counts_expanded_audio(gateway: httpx.Client, real_asr: RealVllm) -> None:
    model = real_asr.served_model_name
    text = unique_text(8)
    known = wav(4.0, tone=520.0)
    expanded = post(gateway, body(model, text, input_audio(known))).json()["usage"]["prompt_tokens"]
    too_many = real_asr.max_model_len - expanded + 1
    # The clip's count known, then a new clip of a new length (counted once vLLM expanded it).
    for clip in (known, wav(4.0, tone=530.0, rate=22_050)):
        payload = body(model, text, input_audio(clip), max_tokens=too_many)
        refused = gateway.post("/v1/chat/completions", json=payload)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"


def test_an_image_to_an_audio_model_is_the_engines_400(
    gateway: httpx.Client, real_asr: RealVllm
) -> None:
    """The tiny Qwen3-ASR's tokenizer still has an image placeholder, so the gateway sends the
    image; vLLM refuses the modality and the client gets a 400, not a 500."""
    png = base64.b64encode(encode(noise(40, 30, seed=5), "PNG")).decode()
    payload = body(
        real_asr.served_model_name,
        "what is this",
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
    )
    refused = gateway.post("/v1/chat/completions", json=payload)
    assert refused.status_code == 400, refused.text
    assert "image" in refused.json()["error"]["message"]


def test_vllms_own_server_names_a_clip_as_the_gateway_does(
    gateway: httpx.Client, asr: EngineUnderTest, real_asr: RealVllm
) -> None:
    """Mixed traffic: a clip first sent straight to vLLM's HTTP server is recognised by the
    gateway's router, and hits vLLM's cache, when a client sends it through the gateway."""
    model = real_asr.served_model_name
    text = unique_text()
    clip = wav(2.0, tone=640.0)
    payload = body(model, text, input_audio(clip))
    with kv_listener(asr) as events:
        direct = httpx.post(f"{real_asr.http_url}/v1/chat/completions", json=payload, timeout=60)
        assert direct.status_code == 200, direct.text
        seen = events.wait_for(lambda found: bool(media_keys(found)))
    assert set(media_keys(seen)) == {content_identity(clip)}
    holder = {rank for rank, _ in media_keys(seen)[content_identity(clip)]}
    settle(gateway, events)
    before = prefix_hits(real_asr)
    through = post(gateway, payload)
    after = prefix_hits(real_asr)
    rank, cached, _, _ = route(through)
    assert {rank} == holder
    assert cached >= qwen3_asr_tokens(2.0)
    assert after[rank] - before.get(rank, 0.0) >= cached
