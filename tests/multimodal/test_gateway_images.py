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

from app.server import create_app
from app.settings import GatewaySettings
from multimodal import MediaConfig, MediaPreparer
from multimodal.identity import pixel_identity, url_identity
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conformance.helpers import kv_listener
from tests.conftest import TINY_TOKENIZER
from tests.multimodal.pictures import data_uri, encode, noise
from tests.support.engines import EngineUnderTest

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


def test_two_images_reach_the_engine_and_reencodings_hit_its_prefix_cache(
    gateway: httpx.Client, image_server: ImageServer, mock_vllm: EngineUnderTest
) -> None:
    first, second = noise(300, 200, seed=21), noise(150, 150, seed=22)
    first_id, second_id = pixel_identity(first), pixel_identity(second)
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
                        keys.update(k for k in block_keys or () if isinstance(k, str))
            return keys

        seen = events.wait_for(lambda found: {first_id, second_id} <= named(found))
    image_blocks = [e for e in seen if e.kind == "BlockStored" and IMAGE_TOKEN in e.token_ids]
    assert sum(e.token_ids.count(IMAGE_TOKEN) for e in image_blocks) >= (
        first_tokens + second_tokens - 2 * mock_vllm.block_size
    )
    assert image_server.hits["/first.png"] == 1
    first_pass_cached = cached_tokens(mock_vllm) - before

    # The same pictures as lossless WebP: a new URL and a new data URI, the same identities.
    url_webp = image_server.put("/first.webp", encode(first, "WEBP", lossless=True), "image/webp")
    again_uri = data_uri(encode(second, "WEBP", lossless=True), "image/webp")
    before = cached_tokens(mock_vllm)
    response = chat(gateway, [url_webp, again_uri])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == prompt_tokens
    hit = cached_tokens(mock_vllm) - before
    block = mock_vllm.block_size
    assert hit >= (prompt_tokens - 1) // block * block - block
    assert hit > first_pass_cached
    assert hit >= text_tokens - block + first_tokens + second_tokens

    # Same sizes (so the same token ids) but other pixels in the second image: its blocks miss.
    other = data_uri(encode(noise(150, 150, seed=99), "PNG"))
    before = cached_tokens(mock_vllm)
    response = chat(gateway, [url_webp, other])
    assert response.status_code == 200, response.text
    partial = cached_tokens(mock_vllm) - before
    assert partial < hit
    assert partial <= text_tokens + first_tokens


def test_the_gateway_learns_image_token_counts_from_the_engine(
    gateway: httpx.Client, preparer: MediaPreparer
) -> None:
    picture = noise(100, 60, seed=31)
    assert preparer.learned.get(pixel_identity(picture)) is None
    response = chat(gateway, [data_uri(encode(picture, "PNG"))])
    assert response.status_code == 200, response.text
    assert preparer.learned.get(pixel_identity(picture)) == mock_tokens(100, 60)


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
                expected in (keys or ())
                for event in found
                if event.kind == "BlockStored"
                for keys in event.extra_keys or ()
            )
        )
    # The engine fetched the image itself; the gateway never did.
    assert image_server.hits["/passthrough.png"] == 1


def test_cli_image_flags_reach_the_media_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.cli import build_parser, settings_from_args

    monkeypatch.setenv("RANKGATE_IMAGE_ALLOW_NETWORK", "10.0.0.0/8, 127.0.0.0/8")
    args = build_parser().parse_args(
        ["serve", "--media-mode", "passthrough", "--max-images", "3", "--max-image-bytes", "999"]
    )
    media = settings_from_args(args).media
    assert (media.mode, media.max_images, media.max_image_bytes) == ("passthrough", 3, 999)
    assert media.allowed_networks == ("10.0.0.0/8", "127.0.0.0/8")
    with pytest.raises(SystemExit, match="invalid image options: max_images must be > 0"):
        settings_from_args(build_parser().parse_args(["serve", "--max-images", "0"]))
