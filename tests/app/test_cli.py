"""``rankgate`` command line: flags, RANKGATE_* env, and the mock-engine subcommand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rankgate.app.cli import build_parser, settings_from_args

ROOT = Path(__file__).resolve().parents[2]


def test_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(
        ["serve", "--engine", "10.0.0.1:50051", "--port", "9000", "--policy", "load"]
    )
    settings = settings_from_args(args)
    assert (settings.engine, settings.port, settings.policy) == ("10.0.0.1:50051", 9000, "load")
    assert settings.host == "127.0.0.1"
    assert settings.tokenizer is None


def test_a_repeatable_flag_not_given_keeps_its_settings_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = build_parser().parse_args(["serve", "--audio-containers", "wav"])
    media = settings_from_args(args).media
    assert media.allowed_audio_containers == ("wav",)
    assert media.allowed_video_containers == ("mp4", "webm")
    monkeypatch.setenv("RANKGATE_VIDEO_CONTAINERS", "webm,avi")
    media = settings_from_args(build_parser().parse_args(["serve"])).media
    assert media.allowed_video_containers == ("webm", "avi")
    with pytest.raises(SystemExit, match="unknown containers"):
        settings_from_args(build_parser().parse_args(["serve", "--audio-containers", "wma"]))


def test_env_defaults_and_flag_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKGATE_ENGINE", "vllm:50051")
    monkeypatch.setenv("RANKGATE_PORT", "8123")
    monkeypatch.setenv("RANKGATE_SERVED_MODEL_NAME", "public")
    monkeypatch.setenv("RANKGATE_ACCESS_LOG", "true")
    monkeypatch.setenv("RANKGATE_TOOL_CALL_PARSER", "hermes")
    settings = settings_from_args(build_parser().parse_args(["serve", "--port", "9001"]))
    assert settings.engine == "vllm:50051"
    assert settings.port == 9001
    assert settings.served_model_name == "public"
    assert settings.access_log is True
    assert settings.tool_call_parser == "hermes"


def test_bad_env_value_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKGATE_PORT", "eighty")
    with pytest.raises(SystemExit, match="RANKGATE_PORT"):
        build_parser()


@pytest.mark.parametrize(
    ("name", "value"), [("RANKGATE_WORKERS", "0"), ("RANKGATE_ACCESS_LOG", "maybe")]
)
def test_an_env_value_its_flag_refuses_is_reported(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=f"{name}='{value}' is invalid"):
        build_parser()


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "nonsense"])


def test_mock_engine_subcommand_is_registered() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rankgate.app.cli", "mock-engine", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    assert "--dp-size" in out.stdout


def test_missing_tokenizer_fails_startup_with_guidance(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rankgate.app.cli",
            "serve",
            "--port",
            "0",
            "--tokenizer",
            str(tmp_path),
            "--mock-speed",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode != 0
    assert "--tokenizer" in out.stderr
    assert str(tmp_path) in out.stderr
