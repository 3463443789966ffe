"""A purpose-built vLLM gRPC server for the sidecar's own tests.

It answers exactly what a test sets (discovery payloads, health states and error codes,
stream shapes), and records what the sidecar sent, so each rule of the sidecar can be driven
through the real gRPC surface, including engines the mocker would never imitate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rankgate.sidecar.types import Delta, PreparedRequest, SamplingParams, StoppingParams
from rankgate.wire.proto.vllm import (
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    kv_transfer_pb2_grpc,
)

Stream = Callable[[Any, Any], AsyncIterator[Any]]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The time a test's own endless stream takes per token, so it paces like an engine instead of
# flooding the sidecar.
TOKEN_STEP_S = 0.01


def model_info(**overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "model_id": "org/fake",
        "served_model_name": "fake",
        "supports_text_input": True,
        "supports_token_ids_input": True,
    }
    fields.update(overrides)
    return control_pb2.ModelInfo(**fields)


def server_info(dp_size: int = 2, start: int = 0, local: int = 0, **overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "engine_version": "0.32.0",
        "api_version": "vllm",
        "instance_id": "fake-1",
        "parallelism": control_pb2.ParallelismInfo(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=dp_size,
            data_parallel_rank=start,
            data_parallel_size_local=local,
        ),
        "max_model_len": 2048,
        "kv_block_size": 16,
        "total_kv_blocks": 200,
        "max_running_requests": 8,
        "max_batched_tokens": 4096,
    }
    fields.update(overrides)
    return control_pb2.ServerInfo(**fields)


def finish(reason: Any = inference_pb2.FinishInfo.LENGTH, tokens: int = 0) -> Any:
    return inference_pb2.FinishInfo(finish_reason=reason, num_output_tokens=tokens)


@dataclass
class Received:
    request: Any
    rank: str | None


@dataclass
class FakeVllm:
    model: Any = field(default_factory=model_info)
    server: Any = field(default_factory=server_info)
    # A list of KvEventSource messages, or a status code Control answers with instead.
    kv_sources: list[Any] | grpc.StatusCode = field(default_factory=list)
    kv_transfer_sources: list[Any] | grpc.StatusCode = grpc.StatusCode.UNIMPLEMENTED
    # service -> serving status, or a status code Check fails with.
    health: dict[str, int | grpc.StatusCode] = field(
        default_factory=lambda: {"": SERVING, "vllm.Control": SERVING, "vllm.Inference": SERVING}
    )
    token_delay: float = 0.0
    stream: Stream | None = None
    received: list[Received] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    dropped: list[str] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    health_checks: int = 0
    # The user agent of each Check, in order; a Check waits this long before it answers, and
    # is counted in health_cancelled when its caller gives up first.
    health_agents: list[str] = field(default_factory=list)
    health_stall: float = 0.0
    health_cancelled: int = 0
    _abort_events: dict[str, asyncio.Event] = field(default_factory=dict)

    async def default_stream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """prompt_info, then one token per message, then finish_info (LENGTH)."""
        yield inference_pb2.GenerateResponse(
            prompt_info=inference_pb2.PromptInfo(num_prompt_tokens=len(request.token_ids.ids))
        )
        aborted = self._abort_events.setdefault(request.request_id, asyncio.Event())
        count = request.stopping.max_new_tokens or 4
        for i in range(count):
            if self.token_delay:
                with_timeout = asyncio.wait_for(aborted.wait(), self.token_delay)
                with contextlib.suppress(TimeoutError):
                    await with_timeout
            if aborted.is_set():
                yield inference_pb2.GenerateResponse(
                    outputs=inference_pb2.SequenceOutput(
                        finish_info=finish(inference_pb2.FinishInfo.ABORTED, i)
                    )
                )
                return
            output = inference_pb2.SequenceOutput(text=f"t{i} ", token_ids=[100 + i])
            if i == count - 1:
                output.finish_info.CopyFrom(finish(tokens=count))
            yield inference_pb2.GenerateResponse(outputs=output)


class _Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self, fake: FakeVllm) -> None:
        self.fake = fake

    async def Check(self, request: Any, context: Any) -> Any:
        self.fake.health_checks += 1
        self.fake.health_agents.append(dict(context.invocation_metadata()).get("user-agent", ""))
        if self.fake.health_stall:
            try:
                await asyncio.sleep(self.fake.health_stall)
            except asyncio.CancelledError:
                self.fake.health_cancelled += 1
                raise
        state = self.fake.health.get(request.service, grpc.StatusCode.NOT_FOUND)
        if isinstance(state, grpc.StatusCode):
            await context.abort(state, f"health: {state.name}")
        return health_pb2.HealthCheckResponse(status=state)


class _Control(control_pb2_grpc.ControlServicer):
    def __init__(self, fake: FakeVllm) -> None:
        self.fake = fake

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return self.fake.model

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return self.fake.server

    async def GetKvEventSources(self, request: Any, context: Any) -> Any:
        return await _sources(self.fake.kv_sources, context)

    async def Abort(self, request: Any, context: Any) -> Any:
        for request_id in request.request_ids:
            self.fake.aborts.append(request_id)
            self.fake._abort_events.setdefault(request_id, asyncio.Event()).set()
        return control_pb2.AbortResponse()

    async def ListLoras(self, request: Any, context: Any) -> Any:
        return control_pb2.ListLorasResponse(
            adapters=[control_pb2.LoraAdapter(lora_id=1, lora_name="b"),
                      control_pb2.LoraAdapter(lora_id=2, lora_name="a")]
        )  # fmt: skip


class _KvTransfer(kv_transfer_pb2_grpc.KvTransferServicer):
    def __init__(self, fake: FakeVllm) -> None:
        self.fake = fake

    async def GetKvEventSources(self, request: Any, context: Any) -> Any:
        return await _sources(self.fake.kv_transfer_sources, context)


async def _sources(value: list[Any] | grpc.StatusCode, context: Any) -> Any:
    if isinstance(value, grpc.StatusCode):
        await context.abort(value, f"sources: {value.name}")
    return control_pb2.GetKvEventSourcesResponse(sources=value)


class _Inference(inference_pb2_grpc.InferenceServicer):
    def __init__(self, fake: FakeVllm) -> None:
        self.fake = fake

    async def GenerateStream(self, request: Any, context: Any) -> AsyncIterator[Any]:
        fake = self.fake
        metadata = dict(context.invocation_metadata())
        fake.received.append(Received(request, metadata.get("x-data-parallel-rank")))
        fake.active.add(request.request_id)
        try:
            stream = fake.stream or fake.default_stream
            async for response in stream(request, context):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            # The client dropped the stream: what vLLM turns into an abort. The server cancels
            # its task wherever that task waits; when that was while sending, not inside this
            # generator, the generator learns of it only by being closed.
            fake.dropped.append(request.request_id)
            raise
        finally:
            fake.active.discard(request.request_id)


class FakeServer:
    def __init__(self, fake: FakeVllm) -> None:
        self.fake = fake
        self.server: Any = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        server = grpc.aio.server()
        register: list[tuple[Any, Any]] = [
            (health_pb2_grpc.add_HealthServicer_to_server, _Health),
            (control_pb2_grpc.add_ControlServicer_to_server, _Control),
            (kv_transfer_pb2_grpc.add_KvTransferServicer_to_server, _KvTransfer),
            (inference_pb2_grpc.add_InferenceServicer_to_server, _Inference),
        ]
        for add, servicer in register:
            add(servicer(self.fake), server)
        self.port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        self.server = server

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None


def request(request_id: str = "r", **overrides: Any) -> PreparedRequest:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "prompt_token_ids": (1, 2, 3),
        "sampling": SamplingParams(temperature=0.0),
        "stopping": StoppingParams(max_tokens=3),
    }
    fields.update(overrides)
    return PreparedRequest(**fields)


async def token_step() -> None:
    """One decode step of a stream a test writes: the latency a real engine has per token."""
    await asyncio.sleep(TOKEN_STEP_S)


async def collect(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [delta async for delta in stream]
