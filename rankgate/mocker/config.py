"""Everything that shapes one mock vLLM frontend and its data-parallel group.

Field names are a contract: tests, benches and the gateway's embedded default build this value
directly, and ``rankgate mock-engine`` maps its flags onto it one to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rankgate.mocker.transfer import ROLES, Role

# The tiny tokenizer shipped inside the package: `rankgate mock-engine` uses it unless told
# otherwise, so the gateway finds a tokenizer for the mock's model without extra flags.
BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tiny-tokenizer"
EventFormat = Literal["map", "array"]
GrpcServices = Literal["combined", "split"]
GrpcServer = Literal["inloop", "grpcio"]
GRPC_SERVERS: tuple[GrpcServer, ...] = ("inloop", "grpcio")


class ConfigError(ValueError):
    """A configuration real vLLM would refuse to start with."""


@dataclass(frozen=True, kw_only=True)
class MockEngineConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # "inloop": HTTP/2 served on the event loop (mocker.h2server), cheaper per streamed
    # message; "grpcio": grpc.aio's server, for a client the first cannot serve.
    grpc_server: GrpcServer = "inloop"
    # Data-parallel topology, with vLLM's meaning: this frontend serves ranks
    # ``dp_start_rank .. dp_start_rank + dp_local_size`` (0 = the whole group).
    dp_size: int = 1
    dp_start_rank: int = 0
    dp_local_size: int = 0
    # Model identity as GetModelInfo reports it.
    model: str = "mock-model"
    served_model_aliases: tuple[str, ...] = ()
    model_id: str = ""
    tokenizer: str | None = None
    reasoning_parser: str = ""
    tool_call_parser: str = ""
    engine_version: str = "0.32.0"
    # Capacity as GetServerInfo reports it; ``total_kv_blocks`` spans all local ranks.
    block_size: int = 16
    total_kv_blocks: int = 8192
    max_running_requests: int = 128
    max_batched_tokens: int = 8192
    max_model_len: int = 4096
    # Vocabulary used when no tokenizer is configured.
    vocab_size: int = 32000
    # KV events: PUB at ``kv_events_port + rank`` and replay ROUTER at ``kv_replay_port + rank``.
    # A host with ``*`` or ``::`` binds; a concrete host connects, exactly like vLLM's publisher.
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    kv_events_host: str = "*"
    kv_events_topic: str = ""
    kv_replay_buffer_steps: int = 10_000
    kv_events_hwm: int = 100_000
    # "map": events as maps tagged by "type" (vLLM 0.32); "array": tagged arrays (older builds).
    kv_event_format: EventFormat = "map"
    # "combined": vLLM 0.32's services (KV-event discovery on vllm.Control); "split": vLLM
    # main's, with it on vllm.KvTransfer, Control answering UNIMPLEMENTED for it, and health
    # reported per service name for each.
    grpc_services: GrpcServices = "combined"
    # Timing: 0.0 answers as fast as the CPU allows; 1.0 follows the GPU-like model below;
    # larger values run proportionally faster.
    speed: float = 1.0
    # Per DP rank, a factor on ``speed`` (a throttled GPU, a noisy neighbour), indexed by the
    # rank; ranks past the end run at 1. Only timing changes: answers and events do not.
    rank_speeds: tuple[float, ...] = ()
    prefill_seconds_per_token: float = 50e-6
    decode_step_seconds: float = 8e-3
    decode_seconds_per_sequence: float = 60e-6
    # Paced: > 0 makes every step last exactly this long whatever its batch, on one clock
    # that all local ranks share, so each running stream gets one token per step, as a
    # batched decode step delivers them (the timing model and ``speed`` are then unused).
    paced_step_seconds: float = 0.0
    # The "weights": a different seed is a different model, so the same prompt continues
    # differently; the same seed always reproduces the same outputs.
    seed: int = 0
    # Chance per generated token (after ``min_tokens``, and never the first: a chat model says
    # something) that the model ends by itself with EOS; 0 behaves like a small random model,
    # which practically never samples EOS.
    eos_probability: float = 0.0
    # Input capabilities.
    supports_text_input: bool = True
    supports_multimodal: bool = True
    # The media kinds the model takes (each also needs its placeholder in the tokenizer); others
    # are refused as vLLM refuses a modality its model does not have.
    modalities: tuple[str, ...] = ("image", "audio", "video")
    image_token_id: int | None = None
    image_patch_size: int = 28
    image_max_tokens: int = 1024
    media_max_bytes: int = 20 << 20
    loras: tuple[str, ...] = ()
    max_loras: int = 0
    # Slow start: health reports NOT_SERVING for this long after the server starts.
    startup_delay_s: float = 0.0
    # Where a prefill answer's kv_transfer_params say the KV can be pulled from (NIXL-style).
    # Its side channel: UDP at ``kv_connector_port`` + rank, or a free port per rank when 0.
    kv_connector_host: str = "127.0.0.1"
    kv_connector_port: int = 0
    instance_id: str = ""
    # Disaggregation: "prefill" serves only requests marked do_remote_decode, "decode" only
    # remote prefills whose params a prefill engine issued for the same prompt; "both" serves
    # all. A decode pulls the prompt's KV before its first step: this long at ``speed`` 1.
    role: Role = "both"
    kv_transfer_seconds: float = 2e-3
    kv_transfer_seconds_per_block: float = 20e-6
    # A prefill engine holds a finished prefill's KV this long for a decode engine to read it
    # (vLLM's kv_lease_duration), then frees it whether it was read or not.
    kv_lease_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ConfigError("data_parallel_size must be at least 1")
        if self.dp_start_rank < 0 or self.dp_start_rank >= self.dp_size:
            raise ConfigError(
                f"data_parallel_rank {self.dp_start_rank} is outside the group of {self.dp_size}"
            )
        if self.dp_local_size < 0 or self.dp_start_rank + self.dp_local_size > self.dp_size:
            raise ConfigError(
                f"data_parallel_size_local {self.dp_local_size} from rank {self.dp_start_rank} "
                f"exceeds data_parallel_size {self.dp_size}"
            )
        if self.dp_local_size == 0 and self.dp_start_rank != 0:
            raise ConfigError("data_parallel_size_local 0 means the whole group; start must be 0")
        if self.block_size < 1:
            raise ConfigError("block_size must be positive")
        unknown = set(self.modalities) - {"image", "audio", "video"}
        if unknown:
            raise ConfigError(f"unknown modalities {sorted(unknown)}; known: image, audio, video")
        if self.total_kv_blocks < 2 * self.local_size:
            raise ConfigError(
                "total_kv_blocks must give every local rank two blocks (one is the null block)"
            )
        if self.max_running_requests < 1 or self.max_batched_tokens < 1:
            raise ConfigError("max_running_requests and max_batched_tokens must be positive")
        if self.max_model_len < 1:
            raise ConfigError("max_model_len must be positive")
        if (self.blocks_per_rank - 1) * self.block_size < self.max_model_len:
            # vLLM refuses to start here too: a request of the full context could never be
            # scheduled, and would wait for blocks that no eviction can free.
            raise ConfigError(
                f"max_model_len {self.max_model_len} needs "
                f"{-(-self.max_model_len // self.block_size)} KV blocks per rank besides the "
                f"null block, more than the {self.blocks_per_rank - 1} each rank has"
            )
        if self.speed < 0:
            raise ConfigError("speed must be >= 0 (0 = zero latency)")
        if any(factor <= 0 for factor in self.rank_speeds):
            raise ConfigError("every rank speed factor must be > 0")
        if self.paced_step_seconds < 0:
            raise ConfigError("paced_step_seconds must be >= 0 (0 = not paced)")
        if not self.model.strip():
            raise ConfigError("model (served name) must not be empty")
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ConfigError("eos_probability must lie in [0, 1]")
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.grpc_server not in GRPC_SERVERS:
            raise ConfigError(
                f"grpc_server must be one of {', '.join(GRPC_SERVERS)}, got {self.grpc_server!r}"
            )
        if self.kv_lease_seconds <= 0:
            raise ConfigError("kv_lease_seconds must be > 0")
        if self.kv_transfer_seconds < 0 or self.kv_transfer_seconds_per_block < 0:
            raise ConfigError("KV transfer times must be >= 0")

    def rank_speed(self, rank: int) -> float:
        """``speed`` as rank ``rank`` runs it."""
        factors = self.rank_speeds
        return self.speed * (factors[rank] if rank < len(factors) else 1.0)

    @property
    def local_size(self) -> int:
        return self.dp_local_size or self.dp_size

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.dp_start_rank, self.dp_start_rank + self.local_size))

    @property
    def blocks_per_rank(self) -> int:
        return self.total_kv_blocks // self.local_size

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model, *self.served_model_aliases)

    @property
    def resolved_model_id(self) -> str:
        return self.model_id or self.tokenizer or self.model

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def transfer_seconds(self, prompt_tokens: int) -> float:
        """How long a decode waits for a remote prefill's KV (0 when ``speed`` is 0)."""
        if self.speed == 0.0:
            return 0.0
        blocks = -(-prompt_tokens // self.block_size)
        return (self.kv_transfer_seconds + self.kv_transfer_seconds_per_block * blocks) / self.speed

    def kv_endpoint(self, rank: int) -> str | None:
        if self.kv_events_port is None:
            return None
        return f"tcp://{_bracket(self.kv_events_host)}:{self.kv_events_port + rank}"

    def kv_replay_endpoint(self, rank: int) -> str | None:
        if self.kv_events_port is None or self.kv_replay_port is None:
            return None
        return f"tcp://{_bracket(self.kv_events_host)}:{self.kv_replay_port + rank}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
