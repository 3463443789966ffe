"""Images end to end: HTTP chat request → gateway → mock vLLM, checked on the engine's side.

The mock engine expands each image placeholder into ceil(w/28) * ceil(h/28) tokens, folds the
MediaItem uuid into the identity of the blocks holding them, and publishes those blocks as KV
events whose ``extra_keys`` name the uuid: so the events show which uuids reached the engine,
and its per-rank ``cached_tokens`` counter shows prefix-cache hits on image blocks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.multimodal.identity import content_identity, url_identity
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conformance.helpers import kv_listener
from tests.conftest import TINY_TOKENIZER
from tests.multimodal.pictures import data_uri, encode, noise
from tests.support.engines import EngineUnderTest
from tests.support.metrics import metric_total
from tests.support.polling import wait_until

IMAGE_TOKEN = 5  # <|image|> in the tiny tokenizer, the mock's placeholder
PATCH = 28
RANK = 1
QUESTION = "Which of these two pictures has more blue in it?"


def mock_tokens(width: int, height: int) -> int:
    return math.ceil(width / PATCH) * math.ceil(height / PATCH)


class ImageServer:
    """A loopback HTTP server for image bodies, counting the requests it answers."""

    def __init__(self) -> None:
        self.bodies: dict[str, tuple[bytes, str]] = {}
        self.hits: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                found = server.bodies.get(self.path)
                server.hits[self.path] = server.hits.get(self.path, 0) + 1
                if found is None:
                    self.send_error(404)
                    return
                body, mime = found
                self.send_response(200)
                self.send_header("content-type", mime)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def put(self, path: str, body: bytes, mime: str) -> str:
        self.bodies[path] = (body, mime)
        return self.base + path

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    server = ImageServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def preparer() -> MediaPreparer:
    # Loopback is refused by default; the test's image server lives there.
    return MediaPreparer(MediaConfig(allowed_networks=("127.0.0.0/8",)))


@pytest.fixture(scope="module")
def gateway(mock_vllm: EngineUnderTest, preparer: MediaPreparer) -> Iterator[httpx.Client]:
    settings = GatewaySettings(engine=mock_vllm.target, tokenizer=str(mock_vllm.tokenizer_dir))
    with (
        serve_app(create_app(settings, media=preparer)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client


def chat(
    client: httpx.Client,
    images: list[str],
    text: str = QUESTION,
    model: str = "tiny-llama",
) -> httpx.Response:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 1,
            "temperature": 0,
        },
        headers={"x-data-parallel-rank": str(RANK)},
    )


def cached_tokens(engine: EngineUnderTest) -> int:
    engine.mock.wait_idle()
    return int(engine.mock.stats(RANK).cached_tokens)


def png_id(picture: Any) -> str:
    """The id the gateway gives ``picture`` sent as a PNG (``encode`` is deterministic)."""
    return content_identity(encode(picture, "PNG"))


def test_two_images_reach_the_engine_and_resent_bytes_hit_its_prefix_cache(
    gateway: httpx.Client, image_server: ImageServer, mock_vllm: EngineUnderTest
) -> None:
    first, second = noise(300, 200, seed=21), noise(150, 150, seed=22)
    first_id, second_id = png_id(first), png_id(second)
    first_tokens, second_tokens = mock_tokens(300, 200), mock_tokens(150, 150)

    text_only = chat(gateway, [])
    assert text_only.status_code == 200, text_only.text
    text_tokens = text_only.json()["usage"]["prompt_tokens"]

    url_png = image_server.put("/first.png", encode(first, "PNG"), "image/png")
    before = cached_tokens(mock_vllm)
    with kv_listener(mock_vllm) as events:
        response = chat(gateway, [url_png, data_uri(encode(second, "PNG"))])
        assert response.status_code == 200, response.text
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        # One placeholder per image, each expanded by the engine.
        assert prompt_tokens == text_tokens + first_tokens + second_tokens

        def named(found: list[Any]) -> set[str]:
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

        seen = events.wait_for(lambda found: {first_id, second_id} <= named(found))
    image_blocks = [e for e in seen if e.kind == "BlockStored" and IMAGE_TOKEN in e.token_ids]
    assert sum(e.token_ids.count(IMAGE_TOKEN) for e in image_blocks) >= (
        first_tokens + second_tokens - 2 * mock_vllm.block_size
    )
    assert image_server.hits["/first.png"] == 1
    first_pass_cached = cached_tokens(mock_vllm) - before

    # The same bytes again (the same URL, the same data URI): the same ids, all blocks cached.
    again_uri = data_uri(encode(second, "PNG"))
    before = cached_tokens(mock_vllm)
    response = chat(gateway, [url_png, again_uri])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == prompt_tokens
    hit = cached_tokens(mock_vllm) - before
    block = mock_vllm.block_size
    assert hit >= (prompt_tokens - 1) // block * block - block
    assert hit > first_pass_cached
    assert hit >= text_tokens - block + first_tokens + second_tokens

    # The same pictures re-encoded as lossless WebP are other files, so other ids: their
    # image blocks miss (ids name the bytes, as vLLM's own do).
    url_webp = image_server.put("/first.webp", encode(first, "WEBP", lossless=True), "image/webp")
    before = cached_tokens(mock_vllm)
    response = chat(gateway, [url_webp, again_uri])
    assert response.status_code == 200, response.text
    partial = cached_tokens(mock_vllm) - before
    assert partial < hit
    assert partial <= text_tokens


def test_the_gateway_learns_image_token_counts_from_the_engine(
    gateway: httpx.Client, preparer: MediaPreparer
) -> None:
    picture = noise(100, 60, seed=31)
    assert preparer.learned.get(png_id(picture)) is None
    response = chat(gateway, [data_uri(encode(picture, "PNG"))])
    assert response.status_code == 200, response.text
    assert preparer.learned.get(png_id(picture)) == mock_tokens(100, 60)


def chat_body(images: list[str], **fields: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
    }
    body.update(fields)
    return body


def test_the_context_check_counts_each_image_at_its_expanded_size(
    gateway: httpx.Client, mock_vllm: EngineUnderTest
) -> None:
    """vLLM answers 400 when max_tokens does not fit beside the expanded prompt; so does the
    gateway, from the image's known size, or from the engine's count for a new image."""
    limit = 512  # the conformance mock's max_model_len
    picture = noise(280, 280, seed=41)  # 100 tokens on the mock
    url = data_uri(encode(picture, "PNG"))
    first = gateway.post("/v1/chat/completions", json=chat_body([url]))
    assert first.status_code == 200, first.text
    expanded = first.json()["usage"]["prompt_tokens"]
    fits = limit - expanded
    assert gateway.post("/v1/chat/completions", json=chat_body([url], max_tokens=fits)).is_success
    known = gateway.post("/v1/chat/completions", json=chat_body([url], max_tokens=fits + 1))
    assert known.status_code == 400, known.text
    assert known.json()["error"]["code"] == "context_length_exceeded"
    assert f"your request has {expanded} input tokens" in known.json()["error"]["message"]
    # A new image of the same size: its count is only known once the engine has expanded it.
    for stream, seed in ((False, 42), (True, 43)):
        fresh = data_uri(encode(noise(280, 280, seed=seed), "PNG"))
        body = chat_body([fresh], max_tokens=fits + 1, stream=stream)
        refused = gateway.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    mock_vllm.mock.wait_idle()
    assert all(mock_vllm.mock.stats(rank).active == 0 for rank in mock_vllm.mock.ranks)


def interleaved_body(parts: list[str | bytes]) -> dict[str, Any]:
    """A chat body whose content alternates text (str) and PNG images (bytes) as given."""
    content = [
        {"type": "text", "text": part}
        if isinstance(part, str)
        else {"type": "image_url", "image_url": {"url": data_uri(part)}}
        for part in parts
    ]
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
    }


def test_a_request_with_several_new_images_learns_each_of_them(
    gateway: httpx.Client, preparer: MediaPreparer
) -> None:
    """Each placeholder's run in vLLM's expanded prompt is one image's count; side-by-side
    placeholders merge into one run, which splits evenly among new images of one size."""
    first, second = noise(56, 56, seed=51), noise(140, 84, seed=52)
    third, fourth = noise(84, 84, seed=53), noise(84, 84, seed=54)
    body = interleaved_body(
        ["Compare", encode(first, "PNG"), "with", encode(second, "PNG"), "and then",
         encode(third, "PNG"), encode(fourth, "PNG")]
    )  # fmt: skip
    indexed = metric_total(gateway, "rankgate_routing_index_blocks", medium="device")
    response = gateway.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-rankgate-route"].endswith(";prompt=estimated")
    for picture in (first, second, third, fourth):
        assert preparer.learned.get(png_id(picture)) == mock_tokens(*picture.size)
    # The blocks it stored reach the index with the engine's KV events, after the answer.
    wait_until(
        lambda: metric_total(gateway, "rankgate_routing_index_blocks", medium="device") > indexed,
        10,
        "the first request's blocks were indexed",
    )
    # Every size known now: the repeat is routed on its image blocks, its count exact.
    again = gateway.post("/v1/chat/completions", json=body)
    route = again.headers["x-rankgate-route"]
    assert "estimated" not in route
    cached, total = route.split("cached=")[1].split(";")[0].split("/")
    assert int(total) == again.json()["usage"]["prompt_tokens"]
    assert int(cached) > mock_tokens(56, 56) + mock_tokens(140, 84)


def test_a_new_image_of_a_learnt_size_is_counted_exactly(
    gateway: httpx.Client, preparer: MediaPreparer
) -> None:
    """An unknown model's count depends on the image size alone, so it carries over."""
    learnt, new = noise(168, 112, seed=61), noise(168, 112, seed=62)
    assert gateway.post("/v1/chat/completions", json=interleaved_body([encode(learnt, "PNG")]))
    response = gateway.post("/v1/chat/completions", json=interleaved_body([encode(new, "PNG")]))
    route = response.headers["x-rankgate-route"]
    assert "estimated" not in route
    assert (
        int(route.split("cached=")[1].split(";")[0].split("/")[1])
        == (response.json()["usage"]["prompt_tokens"])
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "http://169.254.169.254/latest/meta-data/",
            "image 1: 169.254.169.254, a link-local address; fetching it is not allowed",
        ),
        (
            "data:image/png;base64,iVBORw0KGgo=",
            "image 1: corrupt PNG header: Pillow cannot read it",
        ),
    ],
)
def test_refused_images_get_a_400_naming_the_image(
    gateway: httpx.Client, url: str, message: str
) -> None:
    good = data_uri(encode(noise(20, 20), "PNG"))
    response = chat(gateway, [good, url])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(message)
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "messages",
        "invalid_image",
    )


def test_unreachable_image_server_path_is_a_400(
    gateway: httpx.Client, image_server: ImageServer
) -> None:
    response = chat(gateway, [image_server.base + "/missing.png"])
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        f"image 0: fetching {image_server.base}/missing.png returned HTTP 404"
    )


def test_models_without_multimodal_support_refuse_images() -> None:
    engine = ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)
    with (
        serve_app(create_app(GatewaySettings(), engine=engine, media=MediaPreparer())) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        response = chat(client, [data_uri(encode(noise(8, 8), "PNG"))], model=SCRIPTED_MODEL)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["message"] == (
            f"`messages` contains images, but the model `{SCRIPTED_MODEL}` does not support "
            "image input."
        )
        assert error["code"] == "model_not_multimodal"
        assert chat(client, [], model=SCRIPTED_MODEL).status_code == 200


def test_passthrough_mode_hands_urls_to_the_engine(
    mock_vllm: EngineUnderTest, image_server: ImageServer
) -> None:
    picture = noise(280, 280, seed=41)
    url = image_server.put("/passthrough.png", encode(picture, "PNG"), "image/png")
    settings = GatewaySettings(
        engine=mock_vllm.target,
        tokenizer=str(mock_vllm.tokenizer_dir),
        media=MediaConfig(mode="passthrough"),
    )
    with (
        serve_app(create_app(settings)) as base,
        httpx.Client(base_url=base, timeout=60) as client,
        kv_listener(mock_vllm) as events,
    ):
        text_tokens = chat(client, [], text="x " * 40).json()["usage"]["prompt_tokens"]
        response = chat(client, [url], text="x " * 40)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == text_tokens + mock_tokens(280, 280)
        expected = url_identity(url)
        events.wait_for(
            lambda found: any(
                [expected, offset] in (keys or ())
                for event in found
                if event.kind == "BlockStored"
                for keys in event.extra_keys or ()
                for offset in range(-64, 64)
            )
        )
    # The engine fetched the image itself; the gateway never did.
    assert image_server.hits["/passthrough.png"] == 1


def test_cli_image_flags_reach_the_media_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankgate.app.cli import build_parser, settings_from_args

    monkeypatch.setenv("RANKGATE_IMAGE_ALLOW_NETWORK", "10.0.0.0/8, 127.0.0.0/8")
    args = build_parser().parse_args(
        ["serve", "--media-mode", "passthrough", "--max-images", "3", "--max-image-bytes", "999"]
    )
    media = settings_from_args(args).media
    assert (media.mode, media.max_images, media.max_image_bytes) == ("passthrough", 3, 999)
    assert media.allowed_networks == ("10.0.0.0/8", "127.0.0.0/8")
    with pytest.raises(SystemExit, match="invalid options: --max-images: max_images must be > 0"):
        settings_from_args(build_parser().parse_args(["serve", "--max-images", "0"]))
