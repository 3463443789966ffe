"""A mock vLLM (its own thread) behind a real gateway (uvicorn on another thread), and the
client-side checks every chaos test makes: complete or cleanly failed responses, no leaked
engine request, no in-flight count left behind, and a gateway that still serves."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import httpx
import orjson

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.gateway import Gateway as ServingGateway
from rankgate.app.server import create_app
from rankgate.app.state import GatewayApp
from rankgate.mocker.config import MockEngineConfig
from rankgate.sidecar import Sidecar
from rankgate.sidecar.admission import Admission
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.mock_engine import MockEngineHandle, running_mock_engine
from tests.support.polling import wait_until
from tests.support.ports import free_port, free_port_range

MODEL = "chaos-llm"
BASE = MockEngineConfig(
    host="127.0.0.1",
    port=0,
    dp_size=2,
    block_size=16,
    model=MODEL,
    tokenizer=str(TINY_TOKENIZER),
    speed=0.0,
    max_model_len=65536,
    # Up to DP=4 with every rank able to hold the whole context besides its null block (the
    # engine checks it).
    total_kv_blocks=16388,
)


def engine_config(**overrides: Any) -> MockEngineConfig:
    fields: dict[str, Any] = {
        "port": free_port(),
        "kv_events_port": free_port_range(2),
        "kv_replay_port": free_port_range(2),
    }
    fields.update(overrides)
    return replace(BASE, **fields)


@contextmanager
def mock_engine(
    config: MockEngineConfig | None = None, **overrides: Any
) -> Iterator[MockEngineHandle]:
    config = replace(config, **overrides) if config is not None else engine_config(**overrides)
    with running_mock_engine(config) as handle:
        yield handle


@dataclass
class Gateway:
    url: str
    app: GatewayApp
    http: httpx.Client

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def serving(self) -> ServingGateway:
        serving = self.app.gateway_state.gateway
        assert serving is not None, "the gateway has not started"
        return serving

    def sidecar(self) -> Sidecar:
        """The engine behind the gateway: always the sidecar here, never a test double."""
        engine = self.serving().engine
        assert isinstance(engine, Sidecar)
        return engine

    def in_flight(self) -> dict[int, int]:
        return self.sidecar().in_flight()

    @property
    def admission(self) -> Admission:
        return self.sidecar().admission


@contextmanager
def gateway(handle: MockEngineHandle, **overrides: Any) -> Iterator[Gateway]:
    settings: dict[str, Any] = {
        "engine": handle.target,
        "tokenizer": str(TINY_TOKENIZER),
        "health_interval": 0.05,
        "startup_timeout": 30.0,
    }
    settings.update(overrides)
    app = create_app(GatewaySettings(**settings))
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield Gateway(url, app, http)


def chat(content: str = "hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


@dataclass
class StreamResult:
    status: int
    events: list[dict[str, Any]]
    done: int
    text: str
    error: dict[str, Any] | None
    finish: str | None


def stream(
    http: httpx.Client, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> StreamResult:
    """One streamed request, read to its end: every event, the [DONE] count, any error."""
    events: list[dict[str, Any]] = []
    done = 0
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            return StreamResult(response.status_code, [], 0, "", response.json()["error"], None)
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done += 1
                continue
            events.append(orjson.loads(data))
    error = next((e["error"] for e in events if "error" in e), None)
    text = ""
    finish = None
    for event in events:
        for choice in event.get("choices", ()):
            delta = choice.get("delta") or {}
            text += delta.get("content") or choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    return StreamResult(200, events, done, text, error, finish)


def assert_clean(handle: MockEngineHandle, gw: Gateway, timeout: float = 10.0) -> None:
    """No engine request left behind, no in-flight count, and the gateway still serves."""
    handle.wait_idle(timeout)
    for rank, stats in handle.all_stats().items():
        assert stats.leaked == 0, f"rank {rank} leaked {stats.leaked} requests"
    wait_until(lambda: not any(gw.in_flight().values()), timeout, "in-flight counts return to 0")
    wait_until(lambda: gw.http.get("/ready").status_code == 200, timeout, "gateway ready")
    response = gw.http.post("/v1/chat/completions", json=chat("still there?", max_tokens=4))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def raw_stream_request(
    port: int, body: dict[str, Any], rcvbuf: int | None = None, request_id: str | None = None
) -> socket.socket:
    """A streaming POST on a raw socket, so a test controls exactly when it reads or hangs up."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    payload = orjson.dumps({**body, "stream": True})
    named = b"" if request_id is None else b"X-Request-Id: " + request_id.encode() + b"\r\n"
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        + named
        + b"Content-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )
    return sock


def refuse_on_rank(handle: MockEngineHandle, rank: int, count: int = -1) -> None:
    """RESOURCE_EXHAUSTED from one rank only (``count`` 0 lifts it)."""
    faults = handle.server.faults
    assert faults is not None
    handle.call(lambda: faults.refuse_on_rank(rank, count, f"rank {rank} queue full"))
