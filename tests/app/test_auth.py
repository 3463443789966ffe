"""API keys and CORS through HTTP: which routes need a key, constant-time checks against
several keys, keys from flags/env/file, keys kept out of logs, and CORS off unless asked."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.auth import AccessConfig, ApiKeyAuth, load_keys
from rankgate.app.server import create_app
from tests.app.processes import wait_ready
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.ports import free_port

KEYS = ("sk-first-3f9a7c", "sk-second-81d2e0")
CHAT = {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "hi"}]}
ORIGIN = "https://app.example"


def gateway(access: AccessConfig) -> Iterator[httpx.Client]:
    engine = ScriptedEngine(scripted_info(TINY_TOKENIZER), TINY_TOKENIZER)
    app = create_app(GatewaySettings(access=access), engine=engine)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def locked() -> Iterator[httpx.Client]:
    yield from gateway(AccessConfig(api_keys=KEYS))


@pytest.fixture(scope="module")
def locked_metrics() -> Iterator[httpx.Client]:
    yield from gateway(AccessConfig(api_keys=KEYS, protect_metrics=True, cors_origins=(ORIGIN,)))


@pytest.fixture(scope="module")
def open_gateway() -> Iterator[httpx.Client]:
    yield from gateway(AccessConfig())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{SCRIPTED_MODEL}"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ],
)
def test_every_api_route_needs_a_key(locked: httpx.Client, method: str, path: str) -> None:
    body: dict[str, Any] = {"model": SCRIPTED_MODEL, "prompt": "x"}
    if path.endswith("chat/completions"):
        body = CHAT
    elif path == "/detokenize":
        body = {"tokens": [5, 6]}
    kwargs = {"json": body} if method == "POST" else {}
    missing = locked.request(method, path, **kwargs)  # type: ignore[arg-type]
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = locked.request(method, path, headers=bearer("sk-first-3f9a7d"), **kwargs)  # type: ignore[arg-type]
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    for key in KEYS:
        good = locked.request(method, path, headers=bearer(key), **kwargs)  # type: ignore[arg-type]
        assert good.status_code == 200, good.text


def test_probes_and_metrics_stay_open_by_default(locked: httpx.Client) -> None:
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert locked.get(path).status_code == 200, path


def test_metrics_can_be_protected(locked_metrics: httpx.Client) -> None:
    assert locked_metrics.get("/metrics").status_code == 401
    assert locked_metrics.get("/metrics", headers=bearer(KEYS[1])).status_code == 200
    assert locked_metrics.get("/health").status_code == 200


@pytest.mark.parametrize(
    "header",
    ["Basic " + KEYS[0], KEYS[0], "Bearer", "Bearer " + KEYS[0] + "x", "Bearer " + KEYS[0][:-1]],
)
def test_malformed_or_near_miss_credentials_are_refused(locked: httpx.Client, header: str) -> None:
    response = locked.get("/v1/models", headers={"Authorization": header})
    assert response.status_code == 401


def test_scheme_is_case_insensitive(locked: httpx.Client) -> None:
    assert locked.get("/v1/models", headers={"Authorization": f"bearer {KEYS[0]}"}).is_success


def test_keys_never_reach_logs_or_reprs(
    locked: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        locked.get("/v1/models", headers=bearer("sk-guess-000"))
        locked.post("/v1/chat/completions", json=CHAT, headers=bearer(KEYS[0]))
    text = caplog.text
    assert all(key not in text for key in (*KEYS, "sk-guess-000"))
    assert all(key not in repr(GatewaySettings(access=AccessConfig(api_keys=KEYS))) for key in KEYS)


def test_cors_is_off_by_default(open_gateway: httpx.Client) -> None:
    preflight = open_gateway.options(
        "/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    plain = open_gateway.get("/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in plain.headers


def test_cors_when_configured_answers_preflight_without_a_key(
    locked_metrics: httpx.Client,
) -> None:
    preflight = locked_metrics.options(
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    refused = locked_metrics.get("/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    other = locked_metrics.options(
        "/v1/models",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"},
    )
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"


def test_cors_headers_reach_a_whole_generation_answer(locked_metrics: httpx.Client) -> None:
    """The CORS layer adds its headers to a chat answer, which the gateway otherwise writes
    past ``send`` in one write (``rankgate.app.serving.http1_writers.WholeAnswer``); without an
    Origin the same answer comes whole, without them."""
    body = {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for origin in (ORIGIN, None):
        headers = bearer(KEYS[0]) | ({"Origin": origin} if origin else {})
        answer = locked_metrics.post("/v1/chat/completions", json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        assert answer.headers.get("access-control-allow-origin") == origin
        if origin:
            assert "x-request-id" in answer.headers["access-control-expose-headers"]


def test_keys_from_flags_env_and_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-file-1\n\nsk-file-2  # rotated 2026-11\nsk-flag\n")
    monkeypatch.setenv("RANKGATE_API_KEY", "sk-env-1, sk-env-2")
    args = build_parser().parse_args(
        ["serve", "--api-key", "sk-flag", "--api-key-file", str(key_file), "--protect-metrics"]
    )
    settings = settings_from_args(args)
    assert settings.access.api_keys == ("sk-flag", "sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2")
    assert settings.access.protect_metrics
    assert settings.access.cors_origins == ()
    monkeypatch.delenv("RANKGATE_API_KEY")
    assert load_keys(None, None) == ()


def test_blank_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="API key"):
        AccessConfig(api_keys=("sk ok",))
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeyAuth(lambda *a: None, AccessConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/docs/oauth2-redirect"])
def test_the_api_description_needs_a_key_when_keys_are_set(
    locked: httpx.Client, open_gateway: httpx.Client, path: str
) -> None:
    missing = locked.get(path)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert locked.get(path, headers=bearer(KEYS[0])).status_code == 200
    # Without keys there is nothing to protect it with.
    assert open_gateway.get(path).status_code == 200


def test_the_api_description_can_be_left_open() -> None:
    for client in gateway(AccessConfig(api_keys=KEYS, protect_docs=False)):
        assert client.get("/openapi.json").status_code == 200
        assert client.get("/v1/models").status_code == 401


def test_keys_from_a_file_named_in_the_environment_stay_off_the_command_line(
    tmp_path: Path,
) -> None:
    """The keys reach the gateway without appearing in its argv (what ``ps`` shows)."""
    key_file = tmp_path / "keys"
    key_file.write_text("sk-from-file-5e1\n")
    port = free_port()
    env = {
        **os.environ,
        "RANKGATE_API_KEY": "sk-from-env-7a2",
        "RANKGATE_API_KEY_FILE": str(key_file),
        "RANKGATE_PORT": str(port),
        "RANKGATE_MOCK_SPEED": "0",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "rankgate.app.cli", "serve", "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, process, 60)
        argv = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"sk-from" not in argv
        assert httpx.get(f"{base}/v1/models", timeout=5).status_code == 401
        for key in ("sk-from-env-7a2", "sk-from-file-5e1"):
            assert httpx.get(f"{base}/v1/models", headers=bearer(key), timeout=5).status_code == 200
    finally:
        process.terminate()
        process.wait(30)
