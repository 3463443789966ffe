"""Every ``rankgate serve`` flag, declared once (:mod:`rankgate.app.config.flags`): the serving,
engine, parser, media, logging and store flags, the hardening flags, and the routing tunables
(:mod:`rankgate.app.config.routing_flags`)."""

from __future__ import annotations

import argparse

from rankgate.app.config.flags import Flag, comma_list, on_off
from rankgate.app.config.routing_flags import ROUTING_FLAGS
from rankgate.app.edge.auth import API_KEY_ENV
from rankgate.app.observability.logs import LOG_FORMATS
from rankgate.app.parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSERS
from rankgate.sidecar import DisaggConfig

POLICIES = ("kv", "load", "round_robin", "engine")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
MAX_WORKERS = 64


def _workers(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"workers must lie in [1, {MAX_WORKERS}]")
    return value


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("--host", "host", "HTTP listen address (default: %(default)s)"),
    Flag("--port", "port", "HTTP port (default: %(default)s)", int),
    Flag(
        "--engine",
        "engine",
        "vLLM gRPC endpoint HOST:PORT; without it the bundled mock engine runs in-process",
    ),
    Flag(
        "--require-engine",
        "require_engine",
        "refuse to start without --engine (or --prefill-engine/--decode-engine) instead of "
        "serving the bundled demo engine; the container image sets "
        "RANKGATE_REQUIRE_ENGINE=true (default: off)",
        on_off,
    ),
    Flag(
        "--prefill-engine",
        "prefill_engine",
        "disaggregated serving: the prefill vLLM's gRPC endpoint HOST:PORT (with "
        "--decode-engine; instead of --engine)",
    ),
    Flag(
        "--decode-engine",
        "decode_engine",
        "disaggregated serving: the decode vLLM's gRPC endpoint HOST:PORT",
    ),
    Flag(
        "--disaggregated",
        "disaggregated",
        "without --prefill-engine/--decode-engine: run a bundled prefill/decode pair of "
        "mock engines (default: off)",
        on_off,
    ),
    Flag(
        "--decode-handoff-timeout",
        "decode_handoff_timeout",
        "seconds a disaggregated decode whose client left is still read for its first "
        "token, so its KV transfer completes, and an aborted prefill for its end "
        "(default: %(default)s)",
        float,
    ),
    Flag(
        "--pd-prefill",
        "disagg.prefill_mode",
        "disaggregated serving: where each prompt is prefilled: auto decides per request "
        "from both engines' caches and queues, remote always uses the prefill engine, local "
        "always the decode engine (default: %(default)s)",
        choices=DisaggConfig.MODES,
    ),
    Flag(
        "--pd-local-prefill-tokens",
        "disagg.local_prefill_tokens",
        "with --pd-prefill auto: a prompt with at most this many tokens not cached on the "
        "decode engine is prefilled there, skipping the transfer (default: %(default)s)",
        int,
    ),
    Flag(
        "--pd-local-prefill-weight",
        "disagg.local_prefill_weight",
        "with --pd-prefill auto: how many times a longer local prefill's tokens weigh "
        "against the prefill engine's uncached and queued ones (default: %(default)s)",
        float,
    ),
    Flag(
        "--pd-transfer-token-cost",
        "disagg.transfer_token_cost",
        "with --pd-prefill auto: the cost of pulling one token's KV, in prefilled tokens "
        "(default: %(default)s)",
        float,
    ),
    Flag(
        "--pd-seed-first-token",
        "disagg.seed_first_token",
        "disaggregated serving: sample the remote prefill's token as the client asked and "
        "stream it as the first token before the decode starts (default: on)",
        on_off,
    ),
    Flag(
        "--prefill-kv-lease",
        "disagg.kv_lease",
        "seconds the prefill engine holds a finished prefill's KV for its decode (vLLM's "
        "kv_lease_duration); a decode not started within it, less a tenth (at most 1 s), is "
        "prefilled again on the decode engine rather than answered from that KV "
        "(default: %(default)s)",
        float,
    ),
    Flag(
        "--tokenizer",
        "tokenizer",
        "tokenizer directory (default: the model dir vLLM reports, or the local HF cache)",
    ),
    Flag(
        "--served-model-name",
        "served_model_name",
        "the model name clients use (default: vLLM's served name)",
    ),
    Flag(
        "--policy",
        "policy",
        "data-parallel routing policy (default: %(default)s)",
        choices=POLICIES,
    ),
    Flag("--log-level", "log_level", "(default: %(default)s)", env=str.lower, choices=LOG_LEVELS),
    Flag(
        "--log-format",
        "log_format",
        "text, or json: one JSON object per line with structured fields (default: %(default)s)",
        env=str.lower,
        choices=LOG_FORMATS,
    ),
    Flag(
        "--workers",
        "workers",
        "gateway processes serving one port, each with its own engine channels and KV-event "
        "subscribers, sharing per-rank load through shared memory (default: %(default)s)",
        _workers,
    ),
    Flag("--chat-template", "chat_template", "Jinja template file"),
    Flag(
        "--tool-call-parser",
        "tool_call_parser",
        "parse tool calls from output (default: the parser vLLM names)",
        choices=TOOL_CALL_PARSERS,
    ),
    Flag(
        "--reasoning-parser",
        "reasoning_parser",
        "split reasoning from output (default: the parser vLLM names)",
        choices=REASONING_PARSER_NAMES,
    ),
    Flag(
        "--startup-timeout",
        "startup_timeout",
        "seconds to wait for the engine at startup (default: %(default)s)",
        float,
    ),
    Flag(
        "--access-log",
        "access_log",
        "one structured line per OpenAI request: id, rank, tokens, cached tokens, queue/TTFT/"
        "total ms and status (default: off; it costs CPU per request)",
        on_off,
    ),
    Flag(
        "--mock-speed",
        "mock_speed",
        "bundled mock engine timing: 0 = zero latency, 1 = GPU-like (default: %(default)s)",
        float,
    ),
    Flag(
        "--media-mode",
        "media.mode",
        "fetch: download, validate and hash images here; passthrough: vLLM fetches http(s) "
        "URLs, identified by a hash of the URL (default: %(default)s)",
        choices=("fetch", "passthrough"),
    ),
    Flag(
        "--image-allow-network",
        "media.allowed_networks",
        "a network image URLs may resolve to although it is loopback, private or "
        "link-local (repeatable; env: comma-separated)",
        env=comma_list,
        repeat=True,
        metavar="CIDR",
    ),
    Flag("--max-images", "media.max_images", "images per request (default: %(default)s)", int),
    Flag(
        "--max-image-bytes",
        "media.max_image_bytes",
        "bytes per image, fetched or inline (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-audio-clips",
        "media.max_audios",
        "audio clips per request (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-audio-bytes",
        "media.max_audio_bytes",
        "bytes per audio clip, fetched or inline (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-audio-seconds",
        "media.max_audio_seconds",
        "seconds per audio clip, declared or decoded (default: %(default)s)",
        float,
    ),
    Flag(
        "--audio-containers",
        "media.allowed_audio_containers",
        "audio containers accepted, of wav, flac, mp3, ogg, webm, mp4 (repeatable; env: "
        "comma-separated; default: all)",
        env=comma_list,
        repeat=True,
        metavar="NAME",
    ),
    Flag(
        "--max-videos",
        "media.max_videos",
        "videos per request (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-video-bytes",
        "media.max_video_bytes",
        "bytes per video, fetched or inline (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-video-seconds",
        "media.max_video_seconds",
        "seconds per video, declared or counted from its packets (default: %(default)s)",
        float,
    ),
    Flag(
        "--max-video-frames",
        "media.max_video_frames",
        "frames per video, declared or counted (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-video-frame-pixels",
        "media.max_video_frame_pixels",
        "pixels per video frame (default: %(default)s, 4K)",
        int,
    ),
    Flag(
        "--video-containers",
        "media.allowed_video_containers",
        "video containers accepted, of mp4, webm, avi (repeatable; env: comma-separated; "
        "default: mp4, webm)",
        env=comma_list,
        repeat=True,
        metavar="NAME",
    ),
    Flag(
        "--decode-workers",
        "media.decode_workers",
        "decoder processes per gateway process: images, audio and video are parsed in them, "
        "never in the gateway's own (default: %(default)s)",
        int,
    ),
    Flag(
        "--decode-queue",
        "media.decode_queue",
        "media items that may wait for a busy decoder process; past them an item is a 503 "
        "to retry (default: %(default)s)",
        int,
    ),
    Flag(
        "--decode-timeout",
        "media.decode_timeout",
        "seconds one item may take in a decoder process before it is killed and the item "
        "refused (default: %(default)s)",
        float,
    ),
    Flag(
        "--decode-cpu-seconds",
        "media.decode_cpu_seconds",
        "CPU seconds one item may use in a decoder process (RLIMIT_CPU) (default: %(default)s)",
        int,
    ),
    Flag(
        "--decode-memory",
        "media.decode_memory_bytes",
        "bytes of address space a decoder process may use, Pillow and FFmpeg included "
        "(RLIMIT_AS) (default: %(default)s)",
        int,
        metavar="BYTES",
    ),
    Flag(
        "--image-fetch-timeout",
        "media.total_timeout",
        "seconds for one image fetch, redirects included (default: %(default)s)",
        float,
    ),
    Flag(
        "--affinity-header",
        "affinity_header",
        "a request header whose value names the client's conversation (e.g. "
        "x-session-id): the kv policy keeps its turns on one rank while load allows, as "
        "it does for prompt_cache_key (default: none)",
    ),
    Flag(
        "--otlp-traces-endpoint",
        "otlp_traces_endpoint",
        "send OpenTelemetry traces of every request to this OTLP endpoint (gRPC, or "
        "HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), continuing the "
        "client's traceparent into vLLM; needs the tracing extra (default: off)",
    ),
    Flag(
        "--responses-store-entries",
        "responses_store.max_entries",
        "stored responses kept per gateway process for previous_response_id and GET "
        "/v1/responses/{id}; 0 stores none (default: %(default)s)",
        int,
    ),
    Flag(
        "--responses-store-bytes",
        "responses_store.max_bytes",
        "bytes of stored responses per gateway process, oldest dropped first "
        "(default: %(default)s)",
        int,
    ),
    Flag(
        "--responses-store-ttl",
        "responses_store.ttl_s",
        "seconds a stored response is kept (default: %(default)s)",
        float,
    ),
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
        "access.protect_metrics",
        "require an API key on /metrics too (default: off)",
        on_off,
    ),
    Flag(
        "--protect-docs",
        "access.protect_docs",
        "with API keys set, require a key on /openapi.json and /docs too (default: on)",
        on_off,
    ),
    Flag(
        "--cors-origin",
        "access.cors_origins",
        "a browser origin allowed by CORS, or '*' (repeatable; env: comma-separated); "
        "CORS is off without one",
        env=comma_list,
        repeat=True,
        metavar="ORIGIN",
    ),
    Flag(
        "--max-body-bytes",
        "limits.max_body_bytes",
        "largest request body accepted (default: %(default)s)",
        int,
    ),
    Flag(
        "--reject-unknown-fields",
        "limits.reject_unknown_fields",
        "answer 400 to a request field Rankgate does not know, as OpenAI does, instead "
        "of ignoring and logging it, as vLLM does (default: off)",
        on_off,
    ),
    Flag(
        "--max-json-depth",
        "limits.max_json_depth",
        "deepest JSON nesting accepted (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-json-containers",
        "limits.max_json_containers",
        "most JSON arrays and objects in one body (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-json-items",
        "limits.max_json_items",
        "most JSON array elements, object members and string escapes in one body "
        "(default: %(default)s)",
        int,
    ),
    Flag(
        "--max-fanout",
        "limits.max_fanout",
        "most engine requests one request may open (completions prompts times n); they "
        "are admitted together (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-header-bytes",
        "connections.max_header_bytes",
        "largest request head (request line and headers) in bytes; larger is 431 "
        "(default: %(default)s)",
        int,
    ),
    Flag(
        "--max-headers",
        "connections.max_headers",
        "most headers in one request; more is 431 (default: %(default)s)",
        int,
    ),
    Flag(
        "--header-timeout",
        "connections.header_timeout",
        "seconds a connection has to send a request's headers, from connecting or from "
        "its previous response (default: %(default)s)",
        float,
    ),
    Flag(
        "--body-timeout",
        "connections.body_timeout",
        "seconds a request has to send its whole body after its headers (default: %(default)s)",
        float,
    ),
    Flag(
        "--keepalive-timeout",
        "connections.keepalive_timeout",
        "seconds an idle keep-alive connection is kept open (default: %(default)s)",
        int,
    ),
    Flag(
        "--max-connections",
        "connections.max_connections",
        "open HTTP connections per worker process; more are answered 503 and closed "
        "(default: %(default)s)",
        int,
    ),
    Flag(
        "--admission-per-rank",
        "admission.per_rank",
        "engine streams admitted per DP rank, split evenly across --workers; 0: twice "
        "the rank's max_running_requests (default: %(default)s)",
        int,
    ),
    Flag(
        "--admission-queue",
        "admission.queue",
        "requests that may wait for a slot on an eligible rank before 429 (default: %(default)s)",
        int,
    ),
    Flag(
        "--admission-timeout",
        "admission.timeout",
        "seconds a request may wait for admission before 429 (default: %(default)s)",
        float,
    ),
    Flag(
        "--stream-stall-timeout",
        "stream_stall_timeout",
        "seconds a client may stop reading a stream before it is cut; 0: never "
        "(default: %(default)s)",
        float,
    ),
    Flag(
        "--shutdown-grace",
        "shutdown_grace",
        "seconds in-flight requests get after SIGTERM (default: %(default)s)",
        float,
    ),
    Flag(
        "--health-interval",
        "health_interval",
        "seconds between engine health checks (default: %(default)s)",
        float,
    ),
    *ROUTING_FLAGS,
)
