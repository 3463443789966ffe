"""Streamed answers through the gateway's SSE response, over a real engine connection: the
middle deltas of a stream go from the engine connection's callback straight to the socket
(``rankgate.app.respond.sse._DirectSink``), and what the client reads is what the response's task
would have written itself, failures included."""

from __future__ import annotations

from typing import Any

import pytest

from rankgate.app.respond import sse
from rankgate.app.respond.stream import _ChatChunks
from rankgate.app.serving.http1_writers import ChunkWriter
from tests.chaos.harness import assert_clean, chat, gateway, mock_engine, stream

pytestmark = pytest.mark.timeout(90)

_VOLATILE = ("id", "created", "system_fingerprint")


def _stable(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in event.items() if k not in _VOLATILE} for event in events]


@pytest.fixture
def puts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of deltas each stream's sink took, appended as they are taken."""
    taken: list[int] = []
    put = sse._DirectSink.put

    def counted(self: sse._DirectSink, delta: Any) -> None:
        taken.append(len(delta.token_ids))
        put(self, delta)

    monkeypatch.setattr(sse._DirectSink, "put", counted)
    return taken


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            chat(
                "direct",
                max_tokens=24,
                temperature=0.0,
                ignore_eos=True,
                logprobs=True,
                top_logprobs=2,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            ),
        ),
        (
            "/v1/completions",
            {
                "model": chat()["model"],
                "prompt": "direct",
                "max_tokens": 24,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 1,
                "stream_options": {"include_usage": True},
            },
        ),
    ],
)
def test_the_middle_of_a_stream_is_written_from_the_engine_callback_as_the_task_would(
    path: str, body: dict[str, Any], puts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    with mock_engine(speed=0.5) as handle, gateway(handle) as gw:
        direct = stream(gw.http, body, path)
        taken = sum(puts)
        with monkeypatch.context() as off:
            # A writer that is never ready: every delta wakes the task, as without the sink.
            off.setattr(ChunkWriter, "ready", lambda self: False)
            through_task = stream(gw.http, body, path)
        assert_clean(handle, gw)
    assert direct.status == through_task.status == 200
    assert direct.done == through_task.done == 1
    assert direct.error is None
    assert _stable(direct.events) == _stable(through_task.events)
    # The first token's chunk and the last delta go through the task; the rest went direct.
    assert taken >= 24 - 4, puts
    assert sum(puts) == taken


def test_an_encoder_failure_inside_the_engine_callback_ends_the_stream_as_in_the_task(
    puts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    encode = _ChatChunks.chunk
    calls = 0

    def failing(self: _ChatChunks, delta: Any) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 6:
            raise RuntimeError("the encoder broke")
        return encode(self, delta)

    body = chat("fail", max_tokens=40, temperature=0.0, ignore_eos=True)
    with mock_engine(speed=0.5) as handle, gateway(handle) as gw:
        monkeypatch.setattr(_ChatChunks, "chunk", failing)
        direct = stream(gw.http, body)
        failed_in_sink = len(puts)
        calls = 0
        with monkeypatch.context() as off:
            off.setattr(ChunkWriter, "ready", lambda self: False)
            through_task = stream(gw.http, body)
        monkeypatch.setattr(_ChatChunks, "chunk", encode)
        assert_clean(handle, gw)
    # The sixth delta failed inside the sink; the engine request was dropped all the same.
    assert failed_in_sink == 4, puts
    assert direct.status == through_task.status == 200
    assert direct.error is not None
    assert direct.error == through_task.error
    assert direct.error["type"] == "internal_error" or direct.error["code"] == "internal_error"
    assert _stable(direct.events) == _stable(through_task.events)
    assert direct.finish is None
