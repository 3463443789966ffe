"""docs/configuration.md is generated from the parser and must be current, and every
``serve`` flag really has the RANKGATE_* twin the page names."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rankgate.app.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen-config-doc"
# Read when the settings are built rather than as a parser default (keys stay out of --help).
READ_AT_STARTUP = {"--api-key"}


def _serve(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            serve: argparse.ArgumentParser = action.choices["serve"]
            return serve
    raise AssertionError("no serve subcommand")


def _env_name(flag: str) -> str:
    return "RANKGATE_" + flag.removeprefix("--").upper().replace("-", "_")


def _sample(action: argparse.Action) -> tuple[str, Any]:
    """An environment value for ``action`` and the default it must produce."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return ("false", False) if action.default else ("true", True)
    if action.choices is not None:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    if action.type is float:
        return "0.75", 0.75
    if action.type is not None and action.type is not str:
        return "3", 3
    if isinstance(action, argparse._AppendAction):
        return "a,b", ["a", "b"]
    return "sample", "sample"


def test_the_committed_reference_is_current() -> None:
    env = {**os.environ, "RANKGATE_PORT": "9999"}  # the page must not depend on the env
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = (ROOT / "docs" / "configuration.md").read_text()
    for action in _serve(build_parser())._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}`" in text


def test_every_serve_flag_has_its_environment_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("RANKGATE_")]:
        monkeypatch.delenv(name)
    actions = [
        a
        for a in _serve(build_parser())._actions
        if a.option_strings and a.dest != "help" and a.option_strings[0] not in READ_AT_STARTUP
    ]
    assert len(actions) > 20
    for action in actions:
        flag = action.option_strings[0]
        raw, expected = _sample(action)
        with monkeypatch.context() as patch:
            patch.setenv(_env_name(flag), raw)
            parsed = build_parser().parse_args(["serve"])
        assert getattr(parsed, action.dest) == expected, f"{_env_name(flag)} does not set {flag}"
