"""Images through the gateway on real vLLM: the tiny LLaVA (64 tokens an image), DP=2.

What the mock engine promises about images, checked on the engine it imitates: the uuid the
gateway sends names the image's blocks in vLLM's KV events, the router routes a repeated image
to the rank holding those blocks and vLLM's own prefix-cache counters confirm the hit, the
learned token count is vLLM's, two images never share a key, the context check counts the
expanded prompt as vLLM's own server does, and the id agrees with the one vLLM's own HTTP
server computes for the same bytes.
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
from tests.multimodal.pictures import encode, noise
from tests.multimodal.test_gateway_images import ImageServer
from tests.support.engines import EngineUnderTest
from tests.support.metrics import metric_total
from tests.support.polling import wait_until
from tests.support.real_vllm import RealVllm

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

IMAGE_TOKENS = 64  # (112 / 14) ** 2 patches, CLS dropped
IMAGE_TOKEN_ID = 5  # "<image>" in the tiny LLaVA's tokenizer
_words = itertools.count()


def unique_text(words: int = 24) -> str:
    """Text no other test sends, long enough to fill a block or two before the image."""
    start = next(_words) * 1000
    return " ".join(f"w{start + i}" for i in range(words))


def png(seed: int, width: int = 120, height: int = 90) -> bytes:
    return encode(noise(width, height, seed=seed), "PNG")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def body(model: str, text: str, *urls: str, **fields: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
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
    """vLLM's ``prefix_cache_hits`` counter per DP rank (its ``engine`` label)."""
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    hits: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine is not None:
                hits[int(engine.group(1))] = float(line.rsplit(" ", 1)[1])
    return hits


def image_keys(events: list[KvEvent]) -> dict[str, list[tuple[int, int]]]:
    """Per image id, the (publishing rank, offset) of every stored block that names it."""
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
def llava(real_llava: RealVllm) -> EngineUnderTest:
    return EngineUnderTest(
        kind="real",
        target=real_llava.target,
        dp_size=real_llava.dp_size,
        block_size=real_llava.block_size,
        served_model_name=real_llava.served_model_name,
        tokenizer_dir=real_llava.model_dir,
        kv_events_base_port=real_llava.kv_events_base_port,
        kv_replay_base_port=real_llava.kv_replay_base_port,
    )


@pytest.fixture(scope="module")
def preparer() -> MediaPreparer:
    return MediaPreparer(MediaConfig(allowed_networks=("127.0.0.0/8",)))


@pytest.fixture(scope="module")
def gateway(real_llava: RealVllm, preparer: MediaPreparer) -> Iterator[httpx.Client]:
    settings = GatewaySettings(
        engine=real_llava.target, tokenizer=str(real_llava.model_dir), startup_timeout=180.0
    )
    with (
        serve_app(create_app(settings, media=preparer)) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    server = ImageServer()
    yield server
    server.close()


def post(client: httpx.Client, payload: dict[str, Any]) -> httpx.Response:
    response = client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 200, response.text
    return response


def settle(gateway: httpx.Client, events: KvEventListener, timeout: float = 30.0) -> None:
    """Wait until the gateway's own KV-event intake has taken in every batch the test's
    listener saw (its per-rank sequence gauge), so the next route sees those blocks."""
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


def test_a_repeated_image_is_routed_to_the_rank_vllm_cached_it_on(
    gateway: httpx.Client,
    llava: EngineUnderTest,
    real_llava: RealVllm,
    preparer: MediaPreparer,
    image_server: ImageServer,
) -> None:
    model = real_llava.served_model_name
    picture = png(101)
    uuid = content_identity(picture)
    text = unique_text()
    text_only = post(gateway, body(model, text)).json()["usage"]["prompt_tokens"]

    with kv_listener(llava) as events:
        first = post(gateway, body(model, text, data_url(picture)))
        seen = events.wait_for(lambda found: uuid in image_keys(found))
    # One placeholder became the image's 64 tokens, as vLLM counted them.
    assert first.json()["usage"]["prompt_tokens"] == text_only + IMAGE_TOKENS
    rank, _, _, estimated = route(first)
    assert estimated  # an unknown model: the first sight of the image counts it as one token
    assert preparer.learned.get(uuid) == IMAGE_TOKENS
    # vLLM names the image's blocks by the uuid the gateway sent: [[uuid, offset]] per block,
    # offsets from the block's start (negative once the image began in an earlier block).
    placed = image_keys(seen)[uuid]
    assert {publisher for publisher, _ in placed} == {rank}
    offsets = sorted(offset for _, offset in placed)
    assert offsets[-1] >= 0
    assert offsets[0] < 0
    settle(gateway, events)

    # The same bytes again, now from an http URL the gateway fetches.
    url = image_server.put("/again.png", picture, "image/png")
    before = prefix_hits(real_llava)
    again = post(gateway, body(model, text, url))
    after = prefix_hits(real_llava)
    again_rank, cached, prompt, estimated = route(again)
    assert (again_rank, prompt, estimated) == (rank, text_only + IMAGE_TOKENS, False)
    assert cached >= IMAGE_TOKENS
    # vLLM's own counters: the hit happened on that rank, at least as large as the router said.
    assert after[rank] - before.get(rank, 0.0) >= cached
    assert image_server.hits["/again.png"] == 1


def test_the_learned_count_is_vllms_prompt_info_count(
    gateway: httpx.Client, real_llava: RealVllm, preparer: MediaPreparer
) -> None:
    picture = png(102)
    post(gateway, body(real_llava.served_model_name, unique_text(), data_url(picture)))
    ids = [40, 41, IMAGE_TOKEN_ID, 42]
    request = inference_pb2.GenerateRequest(
        request_id=f"learned-{time.monotonic_ns()}",
        token_ids=inference_pb2.TokenIds(ids=ids),
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=1),
    )
    request.media.add(
        modality=inference_pb2.MODALITY_IMAGE,
        raw_bytes=picture,
        mime_type="image/png",
        uuid=content_identity(picture),
    )
    with grpc.insecure_channel(real_llava.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        first = next(stub.GenerateStream(request, timeout=60))
    expanded = first.prompt_info.num_prompt_tokens - (len(ids) - 1)
    assert preparer.learned.get(content_identity(picture)) == expanded == IMAGE_TOKENS


def test_two_different_images_never_share_a_key(
    gateway: httpx.Client, llava: EngineUnderTest, real_llava: RealVllm
) -> None:
    model = real_llava.served_model_name
    text = unique_text()
    one, other = png(103), png(104)
    with kv_listener(llava) as events:
        first = post(gateway, body(model, text, data_url(one)))
        events.wait_for(lambda found: content_identity(one) in image_keys(found))
        settle(gateway, events)
        before = prefix_hits(real_llava)
        second = post(gateway, body(model, text, data_url(other)))
        seen = events.wait_for(lambda found: content_identity(other) in image_keys(found))
    after = prefix_hits(real_llava)
    keys = image_keys(seen)
    assert content_identity(one) != content_identity(other)
    assert len(keys[content_identity(other)]) >= IMAGE_TOKENS // real_llava.block_size
    # Only the text before the image can be shared; the router and vLLM agree on that.
    text_blocks = (first.json()["usage"]["prompt_tokens"] - IMAGE_TOKENS) // 32 * 32
    _, cached, _, _ = route(second)
    assert cached <= text_blocks
    assert sum(after.values()) - sum(before.values()) <= text_blocks


def test_several_new_images_in_one_request_are_each_learned(
    gateway: httpx.Client, llava: EngineUnderTest, real_llava: RealVllm, preparer: MediaPreparer
) -> None:
    model = real_llava.served_model_name
    text = unique_text()
    # A size not seen before (a learnt size would make their count known at once).
    pictures = [png(105, 130, 100), png(106, 130, 100)]
    payload = body(model, text, *(data_url(p) for p in pictures))
    with kv_listener(llava) as events:
        first = post(gateway, payload)
        events.wait_for(
            lambda found: all(content_identity(p) in image_keys(found) for p in pictures)
        )
        settle(gateway, events)
    assert route(first)[3]
    for picture in pictures:
        assert preparer.learned.get(content_identity(picture)) == IMAGE_TOKENS
    again = post(gateway, payload)
    rank, cached, prompt, estimated = route(again)
    assert (rank, estimated) == (route(first)[0], False)
    assert prompt == again.json()["usage"]["prompt_tokens"]
    assert cached >= 2 * IMAGE_TOKENS


def test_the_context_check_counts_expanded_images(
    gateway: httpx.Client, real_llava: RealVllm
) -> None:
    """max_tokens that fit beside the prompt as sent but not beside the expanded one: 400.

    (vLLM 0.32's own HTTP server, the Rust frontend, accepts such a request and silently caps
    the output at the context, seen here; the gateway answers as vLLM's OpenAI server does.)
    """
    model = real_llava.served_model_name
    text = unique_text(8)
    known = png(107)
    expanded = post(gateway, body(model, text, data_url(known))).json()["usage"]["prompt_tokens"]
    too_many = real_llava.max_model_len - expanded + 1
    # Its size known, then a new image of a new size (counted once vLLM has expanded it).
    for picture in (known, png(108, 140, 110)):
        payload = body(model, text, data_url(picture), max_tokens=too_many)
        refused = gateway.post("/v1/chat/completions", json=payload)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        assert f"has {expanded} input tokens" in refused.json()["error"]["message"]
    # The largest max_tokens that fits is accepted (streamed, left after the headers: the
    # tiny model would otherwise write all ~1,900 tokens).
    fits = body(model, text, data_url(known), max_tokens=too_many - 1, stream=True)
    with gateway.stream("POST", "/v1/chat/completions", json=fits) as accepted:
        assert accepted.status_code == 200


def test_the_uuid_is_the_id_vllms_own_server_gives_the_image(
    gateway: httpx.Client, llava: EngineUnderTest, real_llava: RealVllm
) -> None:
    """Mixed traffic: an image first sent straight to vLLM's HTTP server is recognised by
    the gateway's router, and hits vLLM's cache, when a client sends it through the gateway."""
    model = real_llava.served_model_name
    text = unique_text()
    picture = png(109)
    payload = body(model, text, data_url(picture))
    with kv_listener(llava) as events:
        direct = httpx.post(f"{real_llava.http_url}/v1/chat/completions", json=payload, timeout=60)
        assert direct.status_code == 200, direct.text
        seen = events.wait_for(lambda found: content_identity(picture) in image_keys(found))
    holder = {rank for rank, _ in image_keys(seen)[content_identity(picture)]}
    settle(gateway, events)
    before = prefix_hits(real_llava)
    through = post(gateway, payload)
    after = prefix_hits(real_llava)
    rank, cached, _, _ = route(through)
    assert {rank} == holder
    assert cached >= IMAGE_TOKENS
    assert after[rank] - before.get(rank, 0.0) >= cached
