"""Flags declared once: each names a settings field that exists and takes its default from it,
the parsed flags build exactly the settings they name, and a refused value names its flag."""

from __future__ import annotations

import pytest

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.config.serve_flags import SERVE_FLAGS
from rankgate.app.config.settings import GatewaySettings


def test_every_flag_names_a_settings_field_once() -> None:
    defaults = GatewaySettings()
    paths = [flag.to for flag in SERVE_FLAGS if flag.to is not None]
    assert len(paths) == len(set(paths))
    for flag in SERVE_FLAGS:
        flag.default(defaults)  # raises AttributeError for a path that names nothing


def test_no_flags_build_the_default_settings() -> None:
    assert settings_from_args(build_parser().parse_args(["serve"])) == GatewaySettings()


@pytest.mark.parametrize(
    ("argv", "env", "path", "expected"),
    [
        (["--port", "9100"], {}, "port", 9100),
        ([], {"RANKGATE_MAX_FANOUT": "3"}, "limits.max_fanout", 3),
        (["--max-connections", "7"], {}, "connections.max_connections", 7),
        ([], {"RANKGATE_CORS_ORIGIN": "https://a, https://b"}, "access.cors_origins",
         ("https://a", "https://b")),
        (["--image-allow-network", "10.0.0.0/8"], {}, "media.allowed_networks", ("10.0.0.0/8",)),
        (["--responses-store-ttl", "5"], {}, "responses_store.ttl_s", 5.0),
        ([], {"RANKGATE_KV_BURST": "9"}, "routing.intake.burst", 9),
        (["--engine", ""], {}, "engine", None),
        (["--no-protect-docs"], {}, "access.protect_docs", False),
    ],
)  # fmt: skip
def test_a_flag_or_its_variable_reaches_its_field(
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    path: str,
    expected: object,
) -> None:
    for name, text in env.items():
        monkeypatch.setenv(name, text)
    value: object = settings_from_args(build_parser().parse_args(["serve", *argv]))
    for part in path.split("."):
        value = getattr(value, part)
    assert value == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-images", "0"], "invalid options: --max-images: max_images must be > 0"),
        (["--kv-burst", "0"], "invalid options: --kv-burst: burst must be at least 1"),
        (["--prefill-engine", "h:1"], "invalid options: --prefill-engine and --decode-engine"),
    ],
)
def test_a_refused_value_stops_startup_naming_its_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as raised:
        settings_from_args(build_parser().parse_args(["serve", *argv]))
    assert str(raised.value).startswith(message)
