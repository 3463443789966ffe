"""``rankgate serve`` and ``rankgate mock-engine``.

Every ``serve`` flag can also come from the environment as ``RANKGATE_<FLAG>`` (dashes as
underscores), which is how containers configure it; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rankgate import __version__
from rankgate.app.access_log import LOG_FORMATS, configure_logging
from rankgate.app.auth import API_KEY_ENV, AccessConfig, load_keys
from rankgate.app.connections import ConnectionLimits
from rankgate.app.limits import InputLimits
from rankgate.app.respond.parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSERS
from rankgate.app.response_store import StoreLimits
from rankgate.app.routing_flags import add_routing_arguments, routing_from_args
from rankgate.app.settings import GatewaySettings
from rankgate.multimodal import MediaConfig
from rankgate.sidecar import AdmissionConfig

POLICIES = ("kv", "load", "round_robin", "engine")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MAX_WORKERS = 64


def _env(name: str, default: Any, convert: Callable[[str], Any] = str) -> Any:
    raw = os.environ.get("RANKGATE_" + name.upper().replace("-", "_"))
    if raw is None or raw == "":
        return default
    try:
        return convert(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(
            f"RANKGATE_{name.upper().replace('-', '_')}={raw!r} is invalid: {exc}"
        ) from None


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _workers(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"workers must lie in [1, {MAX_WORKERS}]")
    return value


def _networks(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclass(frozen=True, slots=True)
class Flag:
    """One ``serve`` flag, whose default is read from ``RANKGATE_<FLAG>`` when that is set.

    ``convert`` parses the flag's value (and the variable's); a ``_bool`` flag is an on/off
    switch. ``env`` parses the variable instead when it differs (a list, a lowered name);
    ``no_env`` flags have no variable. ``repeat`` flags may be given more than once.
    """

    flag: str
    default: Any
    help: str
    convert: Callable[[str], Any] = str
    env: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    repeat: bool = False
    metavar: str | None = None
    no_env: bool = False

    def add(self, parser: argparse.ArgumentParser) -> None:
        options: dict[str, Any] = {"help": self.help}
        if self.convert is _bool:
            options["action"] = argparse.BooleanOptionalAction
        elif self.convert is not str:
            options["type"] = self.convert
        if self.repeat:
            options["action"] = "append"
        if self.choices is not None:
            options["choices"] = self.choices
        if self.metavar is not None:
            options["metavar"] = self.metavar
        if not self.no_env:
            options["default"] = _env(
                self.flag.removeprefix("--"), self.default, self.env or self.convert
            )
        parser.add_argument(self.flag, **options)


def _serve_flags(d: GatewaySettings) -> tuple[Flag, ...]:
    m = d.media
    r = d.responses_store
    return (
        Flag("--host", d.host, "HTTP listen address (default: %(default)s)"),
        Flag("--port", d.port, "HTTP port (default: %(default)s)", int),
        Flag(
            "--engine",
            d.engine,
            "vLLM gRPC endpoint HOST:PORT; without it the bundled mock engine runs in-process",
        ),
        Flag(
            "--require-engine",
            d.require_engine,
            "refuse to start without --engine (or --prefill-engine/--decode-engine) instead of "
            "serving the bundled demo engine; the container image sets "
            "RANKGATE_REQUIRE_ENGINE=true (default: off)",
            _bool,
        ),
        Flag(
            "--prefill-engine",
            d.prefill_engine,
            "disaggregated serving: the prefill vLLM's gRPC endpoint HOST:PORT (with "
            "--decode-engine; instead of --engine)",
        ),
        Flag(
            "--decode-engine",
            d.decode_engine,
            "disaggregated serving: the decode vLLM's gRPC endpoint HOST:PORT",
        ),
        Flag(
            "--disaggregated",
            d.disaggregated,
            "without --prefill-engine/--decode-engine: run a bundled prefill/decode pair of "
            "mock engines (default: off)",
            _bool,
        ),
        Flag(
            "--decode-handoff-timeout",
            d.decode_handoff_timeout,
            "seconds a disaggregated decode whose client left is still read for its first "
            "token, so its KV transfer completes, and an aborted prefill for its end "
            "(default: %(default)s)",
            float,
        ),
        Flag(
            "--tokenizer",
            d.tokenizer,
            "tokenizer directory (default: the model dir vLLM reports, or the local HF cache)",
        ),
        Flag(
            "--served-model-name",
            d.served_model_name,
            "the model name clients use (default: vLLM's served name)",
        ),
        Flag(
            "--policy",
            d.policy,
            "data-parallel routing policy (default: %(default)s)",
            choices=POLICIES,
        ),
        Flag(
            "--log-level", d.log_level, "(default: %(default)s)", env=str.lower, choices=LOG_LEVELS
        ),
        Flag(
            "--log-format",
            d.log_format,
            "text, or json: one JSON object per line with structured fields (default: %(default)s)",
            env=str.lower,
            choices=LOG_FORMATS,
        ),
        Flag(
            "--workers",
            d.workers,
            "gateway processes serving one port, each with its own engine channels and KV-event "
            "subscribers, sharing per-rank load through shared memory (default: %(default)s)",
            _workers,
        ),
        Flag("--chat-template", d.chat_template, "Jinja template file"),
        Flag(
            "--tool-call-parser",
            d.tool_call_parser,
            "parse tool calls from output (default: the parser vLLM names)",
            choices=TOOL_CALL_PARSERS,
        ),
        Flag(
            "--reasoning-parser",
            d.reasoning_parser,
            "split reasoning from output (default: the parser vLLM names)",
            choices=REASONING_PARSER_NAMES,
        ),
        Flag(
            "--startup-timeout",
            d.startup_timeout,
            "seconds to wait for the engine at startup (default: %(default)s)",
            float,
        ),
        Flag(
            "--access-log",
            d.access_log,
            "one structured line per OpenAI request: id, rank, tokens, cached tokens, queue/TTFT/"
            "total ms and status (default: off; it costs CPU per request)",
            _bool,
        ),
        Flag(
            "--mock-speed",
            d.mock_speed,
            "bundled mock engine timing: 0 = zero latency, 1 = GPU-like (default: %(default)s)",
            float,
        ),
        Flag(
            "--media-mode",
            m.mode,
            "fetch: download, validate and hash images here; passthrough: vLLM fetches http(s) "
            "URLs, identified by a hash of the URL (default: %(default)s)",
            choices=("fetch", "passthrough"),
        ),
        Flag(
            "--image-allow-network",
            None,
            "a network image URLs may resolve to although it is loopback, private or "
            "link-local (repeatable; env: comma-separated)",
            env=_networks,
            repeat=True,
            metavar="CIDR",
        ),
        Flag("--max-images", m.max_images, "images per request (default: %(default)s)", int),
        Flag(
            "--max-image-bytes",
            m.max_image_bytes,
            "bytes per image, fetched or inline (default: %(default)s)",
            int,
        ),
        Flag(
            "--image-fetch-timeout",
            m.total_timeout,
            "seconds for one image fetch, redirects included (default: %(default)s)",
            float,
        ),
        Flag(
            "--affinity-header",
            None,
            "a request header whose value names the client's conversation (e.g. "
            "x-session-id): the kv policy keeps its turns on one rank while load allows, as "
            "it does for prompt_cache_key (default: none)",
        ),
        Flag(
            "--otlp-traces-endpoint",
            None,
            "send OpenTelemetry traces of every request to this OTLP endpoint (gRPC, or "
            "HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), continuing the "
            "client's traceparent into vLLM; needs the tracing extra (default: off)",
        ),
        Flag(
            "--responses-store-entries",
            r.max_entries,
            "stored responses kept per gateway process for previous_response_id and GET "
            "/v1/responses/{id}; 0 stores none (default: %(default)s)",
            int,
        ),
        Flag(
            "--responses-store-bytes",
            r.max_bytes,
            "bytes of stored responses per gateway process, oldest dropped first "
            "(default: %(default)s)",
            int,
        ),
        Flag(
            "--responses-store-ttl",
            r.ttl_s,
            "seconds a stored response is kept (default: %(default)s)",
            float,
        ),
    )


def _hardening_flags(d: GatewaySettings) -> tuple[Flag, ...]:
    c = d.connections
    return (
        Flag(
            "--api-key",
            None,
            "require 'Authorization: Bearer KEY' on /v1 routes (repeatable; env "
            f"{API_KEY_ENV}: comma-separated); without any key the API is open",
            repeat=True,
            metavar="KEY",
            no_env=True,
        ),
        Flag(
            "--api-key-file",
            None,
            "a file with one API key per line ('#' comments), added to --api-key",
        ),
        Flag(
            "--protect-metrics",
            d.access.protect_metrics,
            "require an API key on /metrics too (default: off)",
            _bool,
        ),
        Flag(
            "--protect-docs",
            d.access.protect_docs,
            "with API keys set, require a key on /openapi.json and /docs too (default: on)",
            _bool,
        ),
        Flag(
            "--cors-origin",
            None,
            "a browser origin allowed by CORS, or '*' (repeatable; env: comma-separated); "
            "CORS is off without one",
            env=_networks,
            repeat=True,
            metavar="ORIGIN",
        ),
        Flag(
            "--max-body-bytes",
            d.limits.max_body_bytes,
            "largest request body accepted (default: %(default)s)",
            int,
        ),
        Flag(
            "--reject-unknown-fields",
            d.limits.reject_unknown_fields,
            "answer 400 to a request field Rankgate does not know, as OpenAI does, instead "
            "of ignoring and logging it, as vLLM does (default: off)",
            _bool,
        ),
        Flag(
            "--max-json-depth",
            d.limits.max_json_depth,
            "deepest JSON nesting accepted (default: %(default)s)",
            int,
        ),
        Flag(
            "--max-json-containers",
            d.limits.max_json_containers,
            "most JSON arrays and objects in one body (default: %(default)s)",
            int,
        ),
        Flag(
            "--max-json-items",
            d.limits.max_json_items,
            "most JSON array elements, object members and string escapes in one body "
            "(default: %(default)s)",
            int,
        ),
        Flag(
            "--max-fanout",
            d.limits.max_fanout,
            "most engine requests one request may open (completions prompts times n); they "
            "are admitted together (default: %(default)s)",
            int,
        ),
        Flag(
            "--max-header-bytes",
            c.max_header_bytes,
            "largest request head (request line and headers) in bytes; larger is 431 "
            "(default: %(default)s)",
            int,
        ),
        Flag(
            "--max-headers",
            c.max_headers,
            "most headers in one request; more is 431 (default: %(default)s)",
            int,
        ),
        Flag(
            "--header-timeout",
            c.header_timeout,
            "seconds a connection has to send a request's headers, from connecting or from "
            "its previous response (default: %(default)s)",
            float,
        ),
        Flag(
            "--body-timeout",
            c.body_timeout,
            "seconds a request has to send its whole body after its headers (default: %(default)s)",
            float,
        ),
        Flag(
            "--keepalive-timeout",
            c.keepalive_timeout,
            "seconds an idle keep-alive connection is kept open (default: %(default)s)",
            int,
        ),
        Flag(
            "--max-connections",
            c.max_connections,
            "open HTTP connections per worker process; more are answered 503 and closed "
            "(default: %(default)s)",
            int,
        ),
        Flag(
            "--admission-per-rank",
            d.admission.per_rank,
            "engine streams admitted per DP rank, split evenly across --workers; 0: twice "
            "the rank's max_running_requests (default: %(default)s)",
            int,
        ),
        Flag(
            "--admission-queue",
            d.admission.queue,
            "requests that may wait for a slot on an eligible rank before 429 "
            "(default: %(default)s)",
            int,
        ),
        Flag(
            "--admission-timeout",
            d.admission.timeout,
            "seconds a request may wait for admission before 429 (default: %(default)s)",
            float,
        ),
        Flag(
            "--stream-stall-timeout",
            d.stream_stall_timeout,
            "seconds a client may stop reading a stream before it is cut; 0: never "
            "(default: %(default)s)",
            float,
        ),
        Flag(
            "--shutdown-grace",
            d.shutdown_grace,
            "seconds in-flight requests get after SIGTERM (default: %(default)s)",
            float,
        ),
        Flag(
            "--health-interval",
            d.health_interval,
            "seconds between engine health checks (default: %(default)s)",
            float,
        ),
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for flag in _serve_flags(GatewaySettings()):
        flag.add(parser)


def add_hardening_arguments(parser: argparse.ArgumentParser) -> None:
    for flag in _hardening_flags(GatewaySettings()):
        flag.add(parser)


def _hardening(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return {
            "limits": InputLimits(
                max_body_bytes=args.max_body_bytes,
                max_json_depth=args.max_json_depth,
                max_json_containers=args.max_json_containers,
                max_json_items=args.max_json_items,
                max_fanout=args.max_fanout,
                reject_unknown_fields=args.reject_unknown_fields,
            ),
            "connections": ConnectionLimits(
                max_header_bytes=args.max_header_bytes,
                max_headers=args.max_headers,
                header_timeout=args.header_timeout,
                body_timeout=args.body_timeout,
                keepalive_timeout=args.keepalive_timeout,
                max_connections=args.max_connections,
            ),
            "access": AccessConfig(
                api_keys=load_keys(args.api_key, args.api_key_file),
                protect_metrics=args.protect_metrics,
                protect_docs=args.protect_docs,
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
        require_engine=args.require_engine,
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
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
        affinity_header=args.affinity_header or None,
        responses_store=StoreLimits(
            max_entries=args.responses_store_entries,
            max_bytes=args.responses_store_bytes,
            ttl_s=args.responses_store_ttl,
        ),
        **_hardening(args),
    )


def serve(settings: GatewaySettings) -> int:
    configure_logging(settings.log_level, settings.log_format)
    if settings.workers > 1:
        from rankgate.app.workers import run_workers

        return run_workers(settings)
    from rankgate.app.process import serve_worker

    return serve_worker(settings)


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
    from rankgate.mocker.cli import register

    register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
