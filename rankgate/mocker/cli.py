"""``rankgate mock-engine`` (and ``python -m mocker``): run the mock vLLM engine."""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import uvloop

from rankgate.mocker.config import BUNDLED_TOKENIZER, GRPC_SERVERS, ConfigError, MockEngineConfig
from rankgate.mocker.transfer import ROLES


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``mock-engine`` subcommand to an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "mock-engine",
        help="run a mock vLLM engine (gRPC, DP ranks, KV events) for tests and benchmarks",
        description="A mock vLLM 0.32 gRPC engine that starts in well under a second.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run_from_args)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The mock engine's flags, each defaulting to :class:`MockEngineConfig`'s value; in the
    order ``--help`` and the configuration reference list them."""
    defaults = MockEngineConfig()
    _add_serving(parser, defaults)
    _add_engine(parser, defaults)
    _add_behaviour(parser, defaults)
    _add_disaggregation(parser, defaults)
    parser.add_argument("--log-level", default="info")


def _add_serving(parser: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """Where the engine listens, which ranks it serves and which model it says it is."""
    a = parser.add_argument
    a("--host", default=d.host, help="gRPC listen host (default: %(default)s)")
    a("--port", type=int, default=d.port, help="gRPC listen port (default: %(default)s)")
    a(
        "--grpc-server",
        choices=GRPC_SERVERS,
        default=d.grpc_server,
        help="inloop: HTTP/2 on the event loop (fast); grpcio: grpc.aio's server, as a "
        "fallback for an unusual client (default: %(default)s)",
    )
    a("--dp-size", type=int, default=d.dp_size, help="data-parallel group size")
    a("--dp-start-rank", type=int, default=d.dp_start_rank, help="first rank served here")
    a("--dp-local-size", type=int, default=d.dp_local_size, help="ranks served here; 0 = all")
    a("--model", default=d.model, help="served model name")
    a("--served-model-alias", action="append", default=[], help="extra served name; repeat")
    a("--model-id", default=d.model_id, help="model id reported by GetModelInfo")
    a(
        "--tokenizer",
        # Resolved in config_from_args: the default must not be this checkout's path (the
        # generated configuration reference shows it).
        default=None,
        help="Hugging Face tokenizer directory (real text output); also the model id reported "
        "unless --model-id is given, so a gateway on this machine finds it; 'none' for a "
        "made-up vocabulary (default: the bundled tiny tokenizer)",
    )


def _add_engine(parser: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """The simulated engine's capacity, its KV events and its timing."""
    a = parser.add_argument
    a("--block-size", type=int, default=d.block_size, help="KV block size in tokens")
    a("--total-kv-blocks", type=int, default=d.total_kv_blocks, help="KV blocks, all local ranks")
    a("--max-running-requests", type=int, default=d.max_running_requests, help="per rank")
    a("--max-batched-tokens", type=int, default=d.max_batched_tokens, help="per step, per rank")
    a("--max-model-len", type=int, default=d.max_model_len, help="context length")
    a("--kv-events-port", type=int, default=None, help="KV-event PUB base port (off if absent)")
    a("--kv-replay-port", type=int, default=None, help="KV-event replay ROUTER base port")
    a("--kv-events-host", default=d.kv_events_host, help="'*' binds; a host name connects")
    a("--kv-events-topic", default=d.kv_events_topic, help="KV-event topic")
    a("--kv-event-format", choices=["map", "array"], default=d.kv_event_format)
    a(
        "--grpc-services",
        choices=["combined", "split"],
        default=d.grpc_services,
        help="vLLM 0.32's services, or vLLM main's split layout with vllm.KvTransfer",
    )
    a("--speed", type=float, default=d.speed, help="0 = zero latency; 1 = GPU-like timing")
    a(
        "--rank-speeds",
        default="",
        help="per-rank factors on --speed by DP rank, e.g. 0.4,1,1,1 (others run at 1)",
    )
    a(
        "--paced-step-seconds",
        type=float,
        default=d.paced_step_seconds,
        help="> 0: every step lasts this long on a clock all ranks share, one token per running "
        "stream per step (overrides --speed's timing); 0 = off (default: %(default)s)",
    )


def _add_behaviour(parser: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """What the engine samples and which inputs it takes."""
    a = parser.add_argument
    a("--seed", type=int, default=d.seed, help="base seed")
    a("--eos-probability", type=float, default=d.eos_probability)
    a("--token-ids-only", action="store_true", help="reject text prompts")
    a("--no-multimodal", action="store_true", help="reject media")
    a(
        "--modalities",
        default="image,audio,video",
        help="comma-separated media kinds the model takes (default: %(default)s)",
    )
    a("--lora", action="append", default=[], help="a loaded LoRA adapter name; repeat")
    a("--startup-delay", type=float, default=0.0, help="health NOT_SERVING for this long")


def _add_disaggregation(parser: argparse.ArgumentParser, d: MockEngineConfig) -> None:
    """The engine's part in prefill/decode disaggregation and what a KV transfer costs."""
    a = parser.add_argument
    a(
        "--role",
        choices=ROLES,
        default=d.role,
        help="prefill: only do_remote_decode requests; decode: only remote prefills with a "
        "prefill engine's kv_transfer_params; both: anything (default: %(default)s)",
    )
    a(
        "--kv-transfer-seconds",
        type=float,
        default=d.kv_transfer_seconds,
        help="a decode's KV pull from its prefill: fixed part at speed 1 (default: %(default)s)",
    )
    a(
        "--kv-transfer-seconds-per-block",
        type=float,
        default=d.kv_transfer_seconds_per_block,
        help="a decode's KV pull: seconds per prompt block at speed 1 (default: %(default)s)",
    )
    a(
        "--kv-lease-seconds",
        type=float,
        default=d.kv_lease_seconds,
        help="a prefill engine frees KV no decode engine read after this long "
        "(vLLM's kv_lease_duration; default: %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> MockEngineConfig:
    return MockEngineConfig(
        host=args.host,
        port=args.port,
        grpc_server=args.grpc_server,
        dp_size=args.dp_size,
        dp_start_rank=args.dp_start_rank,
        dp_local_size=args.dp_local_size,
        model=args.model,
        served_model_aliases=tuple(args.served_model_alias),
        model_id=args.model_id,
        tokenizer=_tokenizer(args.tokenizer),
        block_size=args.block_size,
        total_kv_blocks=args.total_kv_blocks,
        max_running_requests=args.max_running_requests,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        kv_events_host=args.kv_events_host,
        kv_events_topic=args.kv_events_topic,
        kv_event_format=args.kv_event_format,
        grpc_services=args.grpc_services,
        speed=args.speed,
        rank_speeds=tuple(float(f) for f in args.rank_speeds.split(",") if f.strip()),
        paced_step_seconds=args.paced_step_seconds,
        seed=args.seed,
        eos_probability=args.eos_probability,
        supports_text_input=not args.token_ids_only,
        supports_multimodal=not args.no_multimodal,
        modalities=tuple(kind.strip() for kind in args.modalities.split(",") if kind.strip()),
        loras=tuple(args.lora),
        startup_delay_s=args.startup_delay,
        role=args.role,
        kv_transfer_seconds=args.kv_transfer_seconds,
        kv_transfer_seconds_per_block=args.kv_transfer_seconds_per_block,
        kv_lease_seconds=args.kv_lease_seconds,
    )


def _tokenizer(given: str | None) -> str | None:
    if given is None:
        return str(BUNDLED_TOKENIZER)
    return None if given.lower() == "none" else given


def run_from_args(args: argparse.Namespace) -> int:
    from rankgate.mocker.server import serve_forever

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        logging.getLogger("rankgate.mocker").error("invalid configuration: %s", exc)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve_forever(config))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mocker", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
