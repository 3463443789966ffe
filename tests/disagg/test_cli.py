"""``rankgate serve`` in the disaggregated topology: flags, env, clear refusals, startup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.disagg.conftest import chat_body, engine_config
from tests.support.mock_engine import running_mock_engine

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> GatewaySettings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_prefill_and_decode_flags() -> None:
    settings = parse(
        "--prefill-engine",
        "p:50051",
        "--decode-engine",
        "d:50051",
        "--decode-handoff-timeout",
        "2.5",
    )
    assert (settings.prefill_engine, settings.decode_engine) == ("p:50051", "d:50051")
    assert settings.decode_handoff_timeout == 2.5
    assert settings.engine is None
    assert settings.split_serving


def test_aggregated_stays_the_default() -> None:
    settings = parse("--engine", "vllm:50051")
    assert not settings.split_serving
    assert settings.decode_handoff_timeout == 30.0


def test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKGATE_PREFILL_ENGINE", "p:1")
    monkeypatch.setenv("RANKGATE_DECODE_ENGINE", "d:2")
    monkeypatch.setenv("RANKGATE_DECODE_HANDOFF_TIMEOUT", "4")
    settings = parse()
    assert (settings.prefill_engine, settings.decode_engine) == ("p:1", "d:2")
    assert settings.decode_handoff_timeout == 4.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--engine", "a:1", "--prefill-engine", "p:1", "--decode-engine", "d:1"],
            "--engine (one aggregated engine) cannot be combined",
        ),
        (["--engine", "a:1", "--disaggregated"], "cannot be combined"),
        (["--prefill-engine", "p:1"], "--prefill-engine and --decode-engine go together"),
        (["--decode-engine", "d:1"], "--prefill-engine and --decode-engine go together"),
        (["--disaggregated", "--decode-handoff-timeout", "-1"], "must be >= 0"),
    ],
)
def test_conflicting_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    assert message in str(caught.value)


def test_models_that_differ_fail_startup_naming_both() -> None:
    with (
        running_mock_engine(engine_config("prefill", model="model-a")) as prefill,
        running_mock_engine(engine_config("decode", model="model-b")) as decode,
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rankgate.app.cli",
                "serve",
                "--port",
                "0",
                "--prefill-engine",
                prefill.target,
                "--decode-engine",
                decode.target,
                "--startup-timeout",
                "20",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
    assert out.returncode != 0
    assert "'model-a'" in out.stderr
    assert "'model-b'" in out.stderr


def test_the_bundled_mock_pair_serves_a_chat() -> None:
    settings = GatewaySettings(disaggregated=True, mock_speed=0.0)
    with (
        serve_app(create_app(settings)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        model = client.get("/v1/models").json()["data"][0]["id"]
        response = client.post("/v1/chat/completions", json=chat_body("hello", model=model))
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
