"""``rankgate serve`` and ``rankgate mock-engine``.

Every ``serve`` flag can also come from the environment as ``RANKGATE_<FLAG>`` (dashes as
underscores), which is how containers configure it; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from app import __version__
from app.access_log import LOG_FORMATS, configure_logging
from app.auth import API_KEY_ENV, AccessConfig, load_keys
from app.limits import InputLimits
from app.respond.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from app.routing_flags import add_routing_arguments, routing_from_args
from app.settings import GatewaySettings
from multimodal.types import MediaConfig
from sidecar.admission import AdmissionConfig

if TYPE_CHECKING:
    import socket

    from sidecar.routing.shared_load import SharedLoadBoard

POLICIES = ("kv", "load", "round_robin", "engine")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MAX_WORKERS = 64


def _env(name: str, default: Any, convert: Callable[[str], Any] = str) -> Any:
    raw = os.environ.get("RANKGATE_" + name.upper().replace("-", "_"))
    if raw is None or raw == "":
        return default
    try:
        return convert(raw)
    except ValueError:
        raise SystemExit(f"RANKGATE_{name.upper().replace('-', '_')}={raw!r} is invalid") from None


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewaySettings()
    a = parser.add_argument
    a("--host", default=_env("host", d.host), help="HTTP listen address (default: %(default)s)")
    a(
        "--port",
        type=int,
        default=_env("port", d.port, int),
        help="HTTP port (default: %(default)s)",
    )
    a(
        "--engine",
        default=_env("engine", d.engine),
        help="vLLM gRPC endpoint HOST:PORT; without it the bundled mock engine runs in-process",
    )
    a(
        "--prefill-engine",
        default=_env("prefill_engine", d.prefill_engine),
        help="disaggregated serving: the prefill vLLM's gRPC endpoint HOST:PORT (with "
        "--decode-engine; instead of --engine)",
    )
    a(
        "--decode-engine",
        default=_env("decode_engine", d.decode_engine),
        help="disaggregated serving: the decode vLLM's gRPC endpoint HOST:PORT",
    )
    a(
        "--disaggregated",
        action=argparse.BooleanOptionalAction,
        default=_env("disaggregated", d.disaggregated, _bool),
        help="without --prefill-engine/--decode-engine: run a bundled prefill/decode pair of "
        "mock engines (default: off)",
    )
    a(
        "--decode-handoff-timeout",
        type=float,
        default=_env("decode_handoff_timeout", d.decode_handoff_timeout, float),
        help="seconds a disaggregated decode whose client left is still read for its first "
        "token, so its KV transfer completes (default: %(default)s)",
    )
    a(
        "--tokenizer",
        default=_env("tokenizer", d.tokenizer),
        help="tokenizer directory (default: the model dir vLLM reports, or the local HF cache)",
    )
    a(
        "--served-model-name",
        default=_env("served_model_name", d.served_model_name),
        help="the model name clients use (default: vLLM's served name)",
    )
    a(
        "--policy",
        choices=POLICIES,
        default=_env("policy", d.policy),
        help="data-parallel routing policy (default: %(default)s)",
    )
    a(
        "--log-level",
        choices=LOG_LEVELS,
        default=_env("log_level", d.log_level).lower(),
        help="(default: %(default)s)",
    )
    a(
        "--log-format",
        choices=LOG_FORMATS,
        default=_env("log_format", d.log_format).lower(),
        help="text, or json: one JSON object per line with structured fields "
        "(default: %(default)s)",
    )
    a(
        "--workers",
        type=_workers,
        default=_env("workers", d.workers, _workers),
        help="gateway processes serving one port, each with its own engine channels and KV-event "
        "subscribers, sharing per-rank load through shared memory (default: %(default)s)",
    )
    a("--chat-template", default=_env("chat_template", d.chat_template), help="Jinja template file")
    a(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=_env("tool_call_parser", d.tool_call_parser),
        help="parse tool calls from output (default: the parser vLLM names)",
    )
    a(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=_env("reasoning_parser", d.reasoning_parser),
        help="split <think> reasoning from output (default: the parser vLLM names)",
    )
    a(
        "--startup-timeout",
        type=float,
        default=_env("startup_timeout", d.startup_timeout, float),
        help="seconds to wait for the engine at startup (default: %(default)s)",
    )
    a(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=_env("access_log", d.access_log, _bool),
        help="one structured line per OpenAI request: id, rank, tokens, cached tokens, queue/TTFT/"
        "total ms and status (default: off; it costs CPU per request)",
    )
    a(
        "--mock-speed",
        type=float,
        default=_env("mock_speed", d.mock_speed, float),
        help="bundled mock engine timing: 0 = zero latency, 1 = GPU-like (default: %(default)s)",
    )
    m = d.media
    a(
        "--media-mode",
        choices=("fetch", "passthrough"),
        default=_env("media_mode", m.mode),
        help="fetch: download, validate and hash images here; passthrough: vLLM fetches http(s) "
        "URLs, identified by a hash of the URL (default: %(default)s)",
    )
    a(
        "--image-allow-network",
        action="append",
        metavar="CIDR",
        default=_env("image_allow_network", None, _networks),
        help="a network image URLs may resolve to although it is loopback, private or "
        "link-local (repeatable; env: comma-separated)",
    )
    a(
        "--max-images",
        type=int,
        default=_env("max_images", m.max_images, int),
        help="images per request (default: %(default)s)",
    )
    a(
        "--max-image-bytes",
        type=int,
        default=_env("max_image_bytes", m.max_image_bytes, int),
        help="bytes per image, fetched or inline (default: %(default)s)",
    )
    a(
        "--image-fetch-timeout",
        type=float,
        default=_env("image_fetch_timeout", m.total_timeout, float),
        help="seconds for one image fetch, redirects included (default: %(default)s)",
    )


def _workers(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"workers must lie in [1, {MAX_WORKERS}]")
    return value


def add_hardening_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewaySettings()
    a = parser.add_argument
    a(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes (repeatable; env "
        f"{API_KEY_ENV}: comma-separated); without any key the API is open",
    )
    a(
        "--api-key-file",
        default=_env("api_key_file", None),
        help="a file with one API key per line ('#' comments), added to --api-key",
    )
    a(
        "--protect-metrics",
        action=argparse.BooleanOptionalAction,
        default=_env("protect_metrics", d.access.protect_metrics, _bool),
        help="require an API key on /metrics too (default: off)",
    )
    a(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        default=_env("cors_origin", None, _networks),
        help="a browser origin allowed by CORS, or '*' (repeatable; env: comma-separated); "
        "CORS is off without one",
    )
    a(
        "--max-body-bytes",
        type=int,
        default=_env("max_body_bytes", d.limits.max_body_bytes, int),
        help="largest request body accepted (default: %(default)s)",
    )
    a(
        "--max-json-depth",
        type=int,
        default=_env("max_json_depth", d.limits.max_json_depth, int),
        help="deepest JSON nesting accepted (default: %(default)s)",
    )
    a(
        "--admission-per-rank",
        type=int,
        default=_env("admission_per_rank", d.admission.per_rank, int),
        help="engine streams admitted per DP rank, split evenly across --workers; 0: twice "
        "the rank's max_running_requests (default: %(default)s)",
    )
    a(
        "--admission-queue",
        type=int,
        default=_env("admission_queue", d.admission.queue, int),
        help="requests that may wait for a slot on an eligible rank before 429 "
        "(default: %(default)s)",
    )
    a(
        "--admission-timeout",
        type=float,
        default=_env("admission_timeout", d.admission.timeout, float),
        help="seconds a request may wait for admission before 429 (default: %(default)s)",
    )
    a(
        "--stream-stall-timeout",
        type=float,
        default=_env("stream_stall_timeout", d.stream_stall_timeout, float),
        help="seconds a client may stop reading a stream before it is cut; 0: never "
        "(default: %(default)s)",
    )
    a(
        "--shutdown-grace",
        type=float,
        default=_env("shutdown_grace", d.shutdown_grace, float),
        help="seconds in-flight requests get after SIGTERM (default: %(default)s)",
    )
    a(
        "--health-interval",
        type=float,
        default=_env("health_interval", d.health_interval, float),
        help="seconds between engine health checks (default: %(default)s)",
    )


def _hardening(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return {
            "limits": InputLimits(
                max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth
            ),
            "access": AccessConfig(
                api_keys=load_keys(args.api_key, args.api_key_file),
                protect_metrics=args.protect_metrics,
                cors_origins=tuple(args.cors_origin or ()),
            ),
            "admission": AdmissionConfig(
                per_rank=args.admission_per_rank,
                queue=args.admission_queue,
                timeout=args.admission_timeout,
            ),
        }
    except (ValueError, OSError) as exc:
        raise SystemExit(f"invalid hardening options: {exc}") from None


def _networks(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _media_config(args: argparse.Namespace) -> MediaConfig:
    try:
        return MediaConfig(
            mode=args.media_mode,
            allowed_networks=tuple(args.image_allow_network or ()),
            max_images=args.max_images,
            max_image_bytes=args.max_image_bytes,
            total_timeout=args.image_fetch_timeout,
        )
    except ValueError as exc:
        raise SystemExit(f"invalid image options: {exc}") from None


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    try:
        return _settings(args)
    except ValueError as exc:
        raise SystemExit(f"invalid options: {exc}") from None


def _settings(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(
        host=args.host,
        port=args.port,
        engine=args.engine or None,
        prefill_engine=args.prefill_engine or None,
        decode_engine=args.decode_engine or None,
        disaggregated=args.disaggregated,
        decode_handoff_timeout=args.decode_handoff_timeout,
        tokenizer=args.tokenizer or None,
        served_model_name=args.served_model_name or None,
        policy=args.policy,
        routing=routing_from_args(args, args.policy),
        log_level=args.log_level,
        chat_template=args.chat_template or None,
        tool_call_parser=args.tool_call_parser or None,
        reasoning_parser=args.reasoning_parser or None,
        startup_timeout=args.startup_timeout,
        access_log=args.access_log,
        log_format=args.log_format,
        workers=args.workers,
        mock_speed=args.mock_speed,
        media=_media_config(args),
        stream_stall_timeout=args.stream_stall_timeout,
        shutdown_grace=args.shutdown_grace,
        health_interval=args.health_interval,
        **_hardening(args),
    )


def serve(settings: GatewaySettings) -> int:
    configure_logging(settings.log_level, settings.log_format)
    if settings.workers > 1:
        from app.workers import run_workers

        return run_workers(settings)
    return serve_worker(settings)


def serve_worker(
    settings: GatewaySettings,
    sockets: list[socket.socket] | None = None,
    shared_load: SharedLoadBoard | None = None,
) -> int:
    """One gateway process; ``sockets`` and ``shared_load`` come from the ``--workers``
    supervisor (:mod:`app.workers`)."""
    import uvicorn

    from app.server import create_app
    from app.shutdown import BACKSTOP_S, GracefulServer

    app = create_app(settings, shared_load=shared_load)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level,
        # The access log is app.access_log's structured line, not uvicorn's.
        access_log=False,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=int(settings.shutdown_grace + BACKSTOP_S),
    )
    server = GracefulServer(config, app.state.shutdown)
    server.run(sockets=sockets)
    # uvicorn returns normally when startup fails; report that as a failure.
    return 0 if server.started else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rankgate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"rankgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve", help="serve the OpenAI API in front of vLLM (or the bundled mock engine)"
    )
    add_serve_arguments(serve_parser)
    add_hardening_arguments(serve_parser)
    add_routing_arguments(serve_parser, _env)
    serve_parser.set_defaults(handler=lambda args: serve(settings_from_args(args)))
    from mocker.cli import register

    register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
