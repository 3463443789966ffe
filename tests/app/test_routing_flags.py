"""Every routing tunable is a ``rankgate serve`` flag with a ``RANKGATE_*`` twin, validated
before anything starts, and listed in ``--help``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest

from rankgate.app.cli import build_parser, settings_from_args
from rankgate.app.config.routing_flags import ROUTING_FLAGS
from rankgate.app.config.settings import GatewaySettings
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.events import IntakeSettings

ROOT = Path(__file__).resolve().parents[2]


def _env_name(flag: str) -> str:
    return "RANKGATE_" + flag.removeprefix("--").upper().replace("-", "_")


def test_every_routing_config_field_has_a_flag() -> None:
    paths = {f.to for f in ROUTING_FLAGS}
    top = {f"routing.{f.name}" for f in msgspec.structs.fields(RoutingConfig)}
    intake = {f"routing.intake.{f.name}" for f in msgspec.structs.fields(IntakeSettings)}
    assert paths == top - {"routing.policy", "routing.intake"} | intake
    assert len({f.flag for f in ROUTING_FLAGS}) == len(ROUTING_FLAGS)


def test_help_documents_each_flag_with_its_default() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rankgate.app.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    ).stdout
    flat = " ".join(out.split())
    assert "routing:" in out
    assert "--policy" in out
    for flag in ROUTING_FLAGS:
        assert flag.flag in out
        default = flag.default(GatewaySettings())
        assert f"(default: {default})" in flat.split(flag.flag, 2)[-1], flag.flag


def test_flags_and_env_reach_the_router_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKGATE_ROUTE_PREFILL_WEIGHT", "2.5")
    monkeypatch.setenv("RANKGATE_ROUTE_DECODE_WEIGHT", "0.7")
    monkeypatch.setenv("RANKGATE_KV_BURST", "32")
    monkeypatch.setenv("RANKGATE_IMAGE_TOKEN_ID", "151655")
    monkeypatch.setenv("RANKGATE_POLICY", "load")
    argv = [
        "serve",
        "--route-decode-weight",
        "0.3",
        "--route-hot-spill-requests",
        "3",
        "--route-predict-ttl",
        "60",
        "--route-pending-ttl",
        "0",
        "--route-offloaded-hit-weight",
        "0.25",
        "--route-offload-index-factor",
        "2",
        "--kv-replay-timeout",
        "0.5",
        "--kv-max-held-batches",
        "100",
        "--kv-coalesce",
        "0",
        "--kv-receive-hwm",
        "5000",
    ]
    config = settings_from_args(build_parser().parse_args(argv)).routing_config()
    assert config == RoutingConfig(
        policy="load",
        prefill_weight=2.5,
        decode_weight=0.3,
        offloaded_hit_weight=0.25,
        hot_spill_requests=3,
        predict_ttl=60.0,
        pending_ttl=0.0,
        offload_index_factor=2.0,
        image_token_id=151655,
        intake=IntakeSettings(
            replay_timeout=0.5,
            max_held_batches=100,
            coalesce=0.0,
            burst=32,
            receive_hwm=5000,
        ),
    )


def test_defaults_are_the_router_defaults() -> None:
    settings = settings_from_args(build_parser().parse_args(["serve"]))
    assert settings.routing_config() == RoutingConfig()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--route-decode-weight", "-1"], "--route-decode-weight: decode_weight must be >= 0"),
        (["--route-copy-weight", "-1"], "--route-copy-weight: copy_weight must be >= 0"),
        (
            ["--route-decode-tokens-cap", "-1"],
            "--route-decode-tokens-cap: decode_tokens_cap must be >= 0",
        ),
        (
            ["--route-offloaded-hit-weight", "1.5"],
            "--route-offloaded-hit-weight: offloaded_hit_weight must lie in [0, 1]",
        ),
        (
            ["--route-hot-spill-requests", "0"],
            "--route-hot-spill-requests: hot_spill_requests must be at least 1",
        ),
        (["--route-predict-ttl", "0"], "--route-predict-ttl: predict_ttl must be positive"),
        (["--image-token-id", "-3"], "--image-token-id: image_token_id must be >= 0"),
        (["--kv-burst", "0"], "--kv-burst: burst must be at least 1"),
        (["--kv-receive-hwm", "0"], "--kv-receive-hwm: receive_hwm must be at least 1"),
        (["--kv-replay-timeout", "0"], "--kv-replay-timeout: replay_timeout must be positive"),
    ],
)
def test_out_of_range_values_stop_startup_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as raised:
        settings_from_args(build_parser().parse_args(["serve", *argv]))
    assert str(raised.value).startswith(f"invalid options: {message}")


def test_malformed_values_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--route-prefill-weight", "heavy"])
    assert "--route-prefill-weight" in capsys.readouterr().err
    monkeypatch.setenv(_env_name("--kv-burst"), "many")
    with pytest.raises(SystemExit, match="RANKGATE_KV_BURST='many' is invalid"):
        build_parser()


def test_an_unknown_policy_from_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKGATE_POLICY", "fastest")
    with pytest.raises(SystemExit, match="unknown routing policy 'fastest'"):
        settings_from_args(build_parser().parse_args(["serve"]))


@pytest.mark.parametrize("flag", [None, "5", "7"])
def test_image_token_id_places_images_in_the_prepared_prompt(flag: str | None) -> None:
    """The tiny tokenizer's ``<|image|>`` is id 5: found by itself, or named by the flag; a
    wrong id finds no placeholder and the request is refused before reaching the engine."""
    from rankgate.app.server import create_app
    from rankgate.multimodal import MediaPreparer
    from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
    from tests.app.serving import serve_app
    from tests.conftest import TINY_TOKENIZER
    from tests.multimodal.pictures import data_uri, encode, noise

    info = msgspec.structs.replace(scripted_info(TINY_TOKENIZER), supports_multimodal=True)
    engine = ScriptedEngine(info, TINY_TOKENIZER)
    argv = ["serve"] + ([] if flag is None else ["--image-token-id", flag])
    settings = settings_from_args(build_parser().parse_args(argv))
    picture = data_uri(encode(noise(20, 20, seed=3), "PNG"))
    content = [
        {"type": "text", "text": "first"},
        {"type": "image_url", "image_url": {"url": picture}},
        {"type": "text", "text": "then"},
        {"type": "image_url", "image_url": {"url": picture}},
    ]
    body = {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
    }
    with (
        serve_app(create_app(settings, engine=engine, media=MediaPreparer())) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        sent = len(engine.requests)
        response = http.post("/v1/chat/completions", json=body)
    if flag == "7":
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            "the rendered prompt has 0 image placeholders for 2 images"
        )
        assert len(engine.requests) == sent
        return
    assert response.status_code == 200, response.text
    prepared = engine.requests[-1]
    positions = [item.position for item in prepared.media]
    assert positions == [i for i, t in enumerate(prepared.prompt_token_ids) if t == 5]
    assert len(positions) == 2
