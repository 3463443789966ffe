"""Hostile media end to end: a decoder that crashes, hangs or allocates without bound fails
the one request that carried the file, through HTTP, while streams in flight on the same
gateway process finish whole and later requests are served by fresh decoders.

The gateway's decoders run :mod:`tests.multimodal.hostile`, which misbehaves when the bytes
start with a marker; the engine holds its streams after their first token until the test has
seen every hostile request answered.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.sidecar.types import Delta, EngineInfo, PreparedRequest
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.multimodal import hostile
from tests.multimodal.clips import wav
from tests.multimodal.pictures import data_uri, encode, noise
from tests.support.polling import until, wait_until

ANSWER = "one two three four five six seven"


class GatedEngine(ScriptedEngine):
    """Holds the next ``hold`` streams after their first delta until ``gate`` is set."""

    def __init__(self, info: EngineInfo, tokenizer_dir: Path) -> None:
        super().__init__(info, tokenizer_dir)
        self.gate = threading.Event()
        self.hold = 0
        self.held = 0

    async def generate(self, request: PreparedRequest) -> AsyncIterator[Delta]:
        holding = self.hold > 0
        self.hold -= holding
        first = True
        async for delta in super().generate(request):
            yield delta
            if holding and first:
                self.held += 1
                await until(self.gate.is_set, 120, "the test to open the gate")
            first = False


def gateway(engine: ScriptedEngine, preparer: MediaPreparer) -> Any:
    return serve_app(create_app(GatewaySettings(), engine=engine, media=preparer))


@pytest.fixture(scope="module")
def engine() -> GatedEngine:
    info = msgspec.structs.replace(scripted_info(TINY_TOKENIZER), supports_multimodal=True)
    engine = GatedEngine(info, TINY_TOKENIZER)
    engine.outputs = [ANSWER]
    return engine


@pytest.fixture(scope="module")
def preparer() -> MediaPreparer:
    config = MediaConfig(decode_timeout=3.0, decode_memory_bytes=512 << 20)
    return MediaPreparer(config, decoder=hostile.HANDLER)


@pytest.fixture(scope="module")
def client(engine: GatedEngine, preparer: MediaPreparer) -> Iterator[httpx.Client]:
    with gateway(engine, preparer) as url, httpx.Client(base_url=url, timeout=120) as http:
        yield http


def image(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_uri(data)}}


def audio(data: bytes) -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}}


def body(*parts: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is in this?"}, *parts]
    return {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
    }


def streamed(client: httpx.Client, part: dict[str, Any]) -> list[str]:
    """The data lines of a streamed answer, read to the end."""
    with client.stream("POST", "/v1/chat/completions", json=body(part, stream=True)) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def text_of(lines: list[str]) -> str:
    chunks = [msgspec.json.decode(line[6:]) for line in lines[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def refusal(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["message"], error["code"]


def test_hostile_media_fail_only_their_own_requests_while_streams_finish_whole(
    client: httpx.Client, engine: GatedEngine, preparer: MediaPreparer
) -> None:
    good = [image(encode(noise(40, 30, seed=seed), "PNG")) for seed in range(3)]
    hostile_bodies = {
        "crash": body(image(hostile.CRASH)),
        "hang": body(image(hostile.HANG)),
        "bomb": body(image(hostile.BOMB)),
        "audio crash": body(audio(hostile.CRASH + wav(0.1))),
    }
    engine.hold = 2
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(streamed, client, part) for part in good[:2]]
        wait_until(lambda: engine.held == 2, 120, lambda: f"{engine.held} streams in flight")
        answers: dict[str, Future[httpx.Response]] = {
            name: pool.submit(client.post, "/v1/chat/completions", json=sent)
            for name, sent in hostile_bodies.items()
        }
        beside = pool.submit(client.post, "/v1/chat/completions", json=body(good[2]))
        outcomes = {name: refusal(answer.result()) for name, answer in answers.items()}
        assert outcomes == {
            "crash": (400, "image 0: the decoder crashed on it (SIGSEGV)", "invalid_image"),
            "hang": (400, "image 0: the decoder took longer than 3 s on it", "invalid_image"),
            "bomb": (
                400,
                "image 0: the decoder needed more than 512 MiB of memory for it",
                "invalid_image",
            ),
            "audio crash": (400, "audio 0: the decoder crashed on it (SIGSEGV)", "invalid_audio"),
        }
        assert beside.result().status_code == 200
        assert beside.result().json()["choices"][0]["message"]["content"] == ANSWER
        assert not any(stream.done() for stream in streams)
        engine.gate.set()
        for stream in streams:
            lines = stream.result()
            assert lines[-1] == "data: [DONE]"
            assert text_of(lines) == ANSWER
    assert preparer.decoders.lost == 4
    after = client.post("/v1/chat/completions", json=body(image(encode(noise(9, 9), "PNG"))))
    assert after.status_code == 200, after.text


def test_a_full_decoder_queue_is_a_503_to_retry() -> None:
    info = msgspec.structs.replace(scripted_info(TINY_TOKENIZER), supports_multimodal=True)
    engine = ScriptedEngine(info, TINY_TOKENIZER)
    preparer = MediaPreparer(MediaConfig(decode_workers=1, decode_queue=0))
    two = [image(encode(noise(20, 20, seed=seed), "PNG")) for seed in (1, 2)]
    with gateway(engine, preparer) as url, httpx.Client(base_url=url, timeout=120) as http:
        response = http.post("/v1/chat/completions", json=body(*two))
        assert refusal(response) == (
            503,
            "image 1: the gateway's decoders are busy; retry shortly",
            "decoders_unavailable",
        )
        assert response.json()["error"]["type"] == "service_unavailable_error"
        assert response.headers["retry-after"] == "1"
        assert http.post("/v1/chat/completions", json=body(two[0])).status_code == 200
    preparer.decoders.close()


def test_decoder_flags_reach_the_media_config() -> None:
    from rankgate.app.cli import build_parser, settings_from_args

    argv = ["serve", "--decode-workers", "3", "--decode-queue", "0", "--decode-timeout", "2.5"]
    argv += ["--decode-cpu-seconds", "4", "--decode-memory", str(300 << 20)]
    media = settings_from_args(build_parser().parse_args(argv)).media
    assert (media.decode_workers, media.decode_queue, media.decode_timeout) == (3, 0, 2.5)
    assert (media.decode_cpu_seconds, media.decode_memory_bytes) == (4, 300 << 20)
    with pytest.raises(SystemExit, match="decode_memory_bytes must be at least 268435456"):
        settings_from_args(build_parser().parse_args(["serve", "--decode-memory", "1000"]))
