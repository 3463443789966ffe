"""Non-streaming requests through HTTP: the app asks the engine for the finished output only
(``PreparedRequest.stream`` false, served by unary engine calls), the answer matches the
streamed one, and a client that hangs up at any point aborts the engine request."""

from __future__ import annotations

import socket
from typing import Any

import orjson
import pytest

from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine
from tests.chaos.harness import assert_clean, chat, gateway, mock_engine, stream
from tests.chaos.test_clients import aborts
from tests.support.mock_engine import MockEngineHandle
from tests.support.polling import wait_until

pytestmark = pytest.mark.timeout(90)


def test_the_engine_is_told_whether_the_client_streams(
    scripted: ScriptedEngine, scripted_client: Any
) -> None:
    scripted.outputs = ["hello there"]
    scripted_client.chat.completions.create(
        model=SCRIPTED_MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert scripted.requests[-1].stream is False
    list(
        scripted_client.chat.completions.create(
            model=SCRIPTED_MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert scripted.requests[-1].stream is True
    scripted_client.completions.create(model=SCRIPTED_MODEL, prompt=["a", "b"], max_tokens=2)
    assert [r.stream for r in list(scripted.requests)[-2:]] == [False, False]


def test_whole_answers_match_the_stream_for_chat_and_completions() -> None:
    with mock_engine(speed=0.0) as handle, gateway(handle) as gw:
        body = chat("same answer", max_tokens=12, temperature=0.0, ignore_eos=True)
        whole = gw.http.post("/v1/chat/completions", json=body)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        streamed = stream(gw.http, {**body, "stream_options": {"include_usage": True}})
        text = "".join(
            e["choices"][0]["delta"].get("content", "") for e in streamed.events if e["choices"]
        )
        assert answer["choices"][0]["message"]["content"] == text
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"] == streamed.events[-1]["usage"]
        assert whole.headers["x-rankgate-route"].startswith("rank=")

        completion = gw.http.post(
            "/v1/completions",
            json={"model": body["model"], "prompt": ["one", "two"], "n": 2, "max_tokens": 5},
        )
        assert completion.status_code == 200, completion.text
        choices = completion.json()["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
        assert all(c["finish_reason"] in ("length", "stop") for c in choices)
        assert completion.json()["usage"]["completion_tokens"] <= 20
        assert_clean(handle, gw)


def _post(port: int, path: str, body: dict[str, Any], pad: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.connect(("127.0.0.1", port))
    payload = orjson.dumps(body) + b" " * pad
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def active(handle: MockEngineHandle) -> int:
    return sum(s.active for s in handle.all_stats().values())


@pytest.mark.parametrize(
    ("path", "body", "pad"),
    [
        ("/v1/chat/completions", chat("leaving", max_tokens=5000, ignore_eos=True), 0),
        ("/v1/chat/completions", chat("leaving", max_tokens=5000, ignore_eos=True, n=3), 0),
        (
            "/v1/completions",
            {"model": chat()["model"], "prompt": ["a", "b"], "max_tokens": 5000},
            0,
        ),
        # A body past uvicorn's 64 KiB high-water mark, which pauses reading the connection.
        ("/v1/chat/completions", chat("leaving", max_tokens=5000, ignore_eos=True), 300_000),
    ],
)
def test_a_hang_up_aborts_every_engine_call(path: str, body: dict[str, Any], pad: int) -> None:
    """5,000 tokens at the mocker's GPU-like pace take a minute: only dropping the unary
    calls ends them at once."""
    calls = body.get("n", 1) * len(body.get("prompt", [""]))
    with mock_engine(speed=1.0) as handle, gateway(handle) as gw:
        before = aborts(handle)
        sock = _post(gw.port, path, body, pad)
        wait_until(
            lambda: active(handle) >= calls,
            10,
            lambda: f"the engine received {active(handle)} of {calls} requests",
        )
        sock.close()
        # Counted by the engine only for a call the gateway dropped, not one that finished.
        wait_until(
            lambda: aborts(handle) >= before + calls,
            10,
            lambda: f"{aborts(handle) - before} of {calls} engine calls aborted",
        )
        assert_clean(handle, gw)
