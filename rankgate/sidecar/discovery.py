"""Control discovery: what model vLLM serves, how its data-parallel ranks are laid out, and
whether Rankgate can serve it (SPEC.md sections 4 and 5).

Validation is strict because every later decision depends on it: routing pins ranks from the
DP layout, the prefix index hashes blocks of ``block_size`` tokens, and the app renders prompts
for ``model_id``. Identity is compared across passes so a restarted engine that came back with
a different model or layout is refused instead of served with stale assumptions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import msgspec

from rankgate.sidecar.errors import DiscoveryError, EngineUnavailable
from rankgate.sidecar.kv_sources import validate_kv_sources
from rankgate.sidecar.status import error_from_rpc
from rankgate.sidecar.types import EngineInfo, KvEventSource, RankCapacity
from rankgate.wire.proto.vllm import control_pb2

log = logging.getLogger(__name__)

API_VERSION = "vllm"

_MODEL_INFO_REQUEST = control_pb2.GetModelInfoRequest()
_SERVER_INFO_REQUEST = control_pb2.GetServerInfoRequest()
_KV_SOURCES_REQUEST = control_pb2.GetKvEventSourcesRequest()


class EngineIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that must stay the same for the gateway to keep serving without a restart."""

    model_id: str
    served_model_name: str
    aliases: tuple[str, ...]
    reasoning_parser: str
    tool_call_parser: str
    supports_text_input: bool
    supports_lora: bool
    supports_multimodal: bool
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    ranks: tuple[int, ...]
    block_size: int

    def changes_from(self, before: EngineIdentity) -> list[str]:
        """``field: old -> new`` for each field that differs from ``before``."""
        return [
            f"{field}: {getattr(before, field)!r} -> {getattr(self, field)!r}"
            for field in self.__struct_fields__
            if getattr(before, field) != getattr(self, field)
        ]


@dataclass(frozen=True, slots=True)
class Discovered:
    """One discovery pass: what the app sees, what must not drift, and the engine's own name
    (the ``model`` field of every request, whatever name clients use)."""

    info: EngineInfo
    identity: EngineIdentity
    wire_model: str


def served_ranks(parallelism: Any) -> tuple[int, ...]:
    """The DP ranks this frontend serves, from (size, start rank, local count)."""
    size = int(parallelism.data_parallel_size)
    start = int(parallelism.data_parallel_rank)
    local = int(parallelism.data_parallel_size_local)
    if size < 1:
        raise DiscoveryError(f"engine reports data_parallel_size {size}; it must be at least 1")
    if local == 0:
        if start != 0:
            raise DiscoveryError(
                f"engine reports start rank {start} without a local rank count; "
                f"a frontend serving the whole DP group of {size} must start at rank 0"
            )
        local = size
    if start + local > size:
        raise DiscoveryError(
            f"engine reports ranks {start}..{start + local - 1}, "
            f"outside the data-parallel group of size {size}"
        )
    return tuple(range(start, start + local))


def _required(field: str, value: str) -> str:
    trimmed = value.strip()
    if not trimmed:
        raise DiscoveryError(f"engine reports an empty {field}")
    return trimmed


def build_discovered(
    model: Any,
    server: Any,
    kv_sources: Sequence[Any],
    grpc_host: str,
    served_model_name: str | None = None,
) -> Discovered:
    """Validate ``ModelInfo``/``ServerInfo``/KV sources and build the engine description."""
    if server.api_version != API_VERSION:
        raise DiscoveryError(
            f"engine reports api_version {server.api_version!r}; Rankgate speaks {API_VERSION!r}"
        )
    model_id = _required("model_id", model.model_id)
    engine_name = _required("served_model_name", model.served_model_name)
    if not model.supports_token_ids_input:
        raise DiscoveryError("engine does not accept token-id prompts (supports_token_ids_input)")
    aliases = tuple(sorted({a.strip() for a in model.served_model_aliases if a.strip()}))
    ranks = served_ranks(server.parallelism)
    if server.HasField("effective_attention_block_size"):
        block_size = int(server.effective_attention_block_size)
    else:
        block_size = int(server.kv_block_size)
    if block_size < 1:
        raise DiscoveryError("engine reports a KV block size of 0")
    if server.max_model_len < 1:
        raise DiscoveryError("engine reports max_model_len 0")
    capacity = _capacity(int(server.total_kv_blocks), int(server.max_running_requests), ranks)
    sources: tuple[KvEventSource, ...] = validate_kv_sources(kv_sources, ranks, grpc_host)

    client_name = engine_name
    client_aliases = aliases
    if served_model_name is not None and served_model_name.strip() != engine_name:
        client_name = served_model_name.strip()
        client_aliases = tuple(sorted({engine_name, *aliases} - {client_name}))

    parallelism = server.parallelism
    identity = EngineIdentity(
        model_id=model_id,
        served_model_name=engine_name,
        aliases=aliases,
        reasoning_parser=model.reasoning_parser.strip(),
        tool_call_parser=model.tool_call_parser.strip(),
        supports_text_input=bool(model.supports_text_input),
        supports_lora=bool(model.supports_lora),
        supports_multimodal=bool(model.supports_multimodal),
        tensor_parallel_size=int(parallelism.tensor_parallel_size),
        pipeline_parallel_size=int(parallelism.pipeline_parallel_size),
        data_parallel_size=int(parallelism.data_parallel_size),
        ranks=ranks,
        block_size=block_size,
    )
    info = EngineInfo(
        model_id=model_id,
        served_model_name=client_name,
        aliases=client_aliases,
        engine_version=server.engine_version,
        instance_id=server.instance_id,
        max_model_len=int(server.max_model_len),
        block_size=block_size,
        dp_size=int(parallelism.data_parallel_size),
        ranks=ranks,
        capacity=capacity,
        max_batched_tokens=int(server.max_batched_tokens),
        supports_text_input=identity.supports_text_input,
        supports_lora=identity.supports_lora,
        supports_multimodal=identity.supports_multimodal,
        reasoning_parser=identity.reasoning_parser,
        tool_call_parser=identity.tool_call_parser,
        kv_event_sources=sources,
    )
    return Discovered(info=info, identity=identity, wire_model=engine_name)


def _capacity(
    total_kv_blocks: int, max_running: int, ranks: tuple[int, ...]
) -> tuple[RankCapacity, ...]:
    """Per-rank capacity: vLLM reports KV blocks summed over local ranks, running requests per
    rank. Zero means "not reported" and stays zero; fewer blocks than ranks is nonsense."""
    per_rank = total_kv_blocks // len(ranks)
    if total_kv_blocks and not per_rank:
        raise DiscoveryError(
            f"engine reports {total_kv_blocks} KV blocks for {len(ranks)} ranks: "
            "less than one block per rank"
        )
    return tuple(RankCapacity(rank, per_rank, max_running) for rank in ranks)


async def discover(
    control: Any,
    kv_transfer: Any,
    grpc_host: str,
    served_model_name: str | None,
    rpc_timeout: float,
) -> Discovered:
    """One discovery pass over ``vllm.Control`` (and ``vllm.KvTransfer`` on newer engines).

    Raises EngineUnavailable for transient RPC failures (the caller retries) and DiscoveryError
    for anything that retrying cannot fix.
    """
    try:
        model = await control.GetModelInfo(_MODEL_INFO_REQUEST, timeout=rpc_timeout)
        server = await control.GetServerInfo(_SERVER_INFO_REQUEST, timeout=rpc_timeout)
    except grpc.aio.AioRpcError as error:
        raise _discovery_error("Control discovery", error) from None
    sources = await _kv_event_sources(control, kv_transfer, rpc_timeout)
    return build_discovered(model, server, sources, grpc_host, served_model_name)


async def _kv_event_sources(control: Any, kv_transfer: Any, rpc_timeout: float) -> Sequence[Any]:
    try:
        response = await control.GetKvEventSources(_KV_SOURCES_REQUEST, timeout=rpc_timeout)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise _discovery_error("Control.GetKvEventSources", error) from None
        try:
            response = await kv_transfer.GetKvEventSources(_KV_SOURCES_REQUEST, timeout=rpc_timeout)
        except grpc.aio.AioRpcError as fallback_error:
            if fallback_error.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _discovery_error("KvTransfer.GetKvEventSources", fallback_error) from None
            log.warning("engine implements neither Control nor KvTransfer GetKvEventSources")
            return ()
    return list(response.sources)


def _discovery_error(what: str, error: grpc.aio.AioRpcError) -> Exception:
    mapped = error_from_rpc(error)
    if isinstance(mapped, EngineUnavailable):
        return mapped
    return DiscoveryError(f"{what} failed: {mapped.message}")
