"""The mock engine's gRPC face: ``vllm.Inference``, ``vllm.Control`` and ``grpc.health.v1``.

:class:`MockServer` wires the pieces (vocabulary, validator, per-rank engines and KV-event
publishers, faults, health) and owns their lifecycle on one event loop. The servicers only
translate between protobuf and the engine's types.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import zmq.asyncio
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from rankgate.mocker.config import MockEngineConfig
from rankgate.mocker.engine import EngineRequest, RankEngine
from rankgate.mocker.events import KvEventPublisher
from rankgate.mocker.faults import SERVICES, SPLIT_SERVICES, Faults
from rankgate.mocker.group import DpGroup
from rankgate.mocker.h2server import H2Server
from rankgate.mocker.media import ImagePolicy, MediaResolver
from rankgate.mocker.model import TokenModel
from rankgate.mocker.output import Emitted, Finish, prompt_logprobs
from rankgate.mocker.request import MockRequest, RequestValidator, parse_rank
from rankgate.mocker.status import RpcStatus
from rankgate.mocker.vocab import Vocabulary, load_vocabulary
from rankgate.wire.proto.vllm import (
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    kv_transfer_pb2_grpc,
)

log = logging.getLogger(__name__)

_FinishReason = inference_pb2.FinishInfo.FinishReason
MAX_MESSAGE = 64 << 20
# Inference calls whose metadata is kept for inspection.
RECEIVED_METADATA = 256
_GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
    ("grpc.optimization_target", "throughput"),
    ("grpc.http2.bdp_probe", 0),
]


class MockServer:
    """A whole mock vLLM frontend; ``await start()`` then ``await stop()`` on one loop."""

    def __init__(self, config: MockEngineConfig) -> None:
        if not config.instance_id:
            config = _with_instance_id(config)
        self.config = config
        self.vocab: Vocabulary = load_vocabulary(
            config.tokenizer, config.vocab_size, config.image_token_id
        )
        policy = None
        vocab = self.vocab
        kinds = config.modalities
        tokens = {
            kind: token if kind in kinds else None
            for kind, token in (
                ("image", vocab.image_token_id),
                ("audio", vocab.audio_token_id),
                ("video", vocab.video_token_id),
            )
        }
        if config.supports_multimodal and any(token is not None for token in tokens.values()):
            policy = ImagePolicy(
                image_token_id=tokens["image"],
                patch_size=config.image_patch_size,
                max_tokens=config.image_max_tokens,
                max_bytes=config.media_max_bytes,
                audio_token_id=tokens["audio"],
                video_token_id=tokens["video"],
            )
        self.model = TokenModel(self.vocab.output_ids, self.vocab.size)
        self.media = MediaResolver(policy)
        self.validator = RequestValidator(config, self.vocab, self.media)
        self._zmq: zmq.asyncio.Context | None = None
        self.group: DpGroup | None = None
        self.faults: Faults | None = None
        self._server: grpc.aio.Server | H2Server | None = None
        self.health = HealthServicer()
        self.port = config.port
        # (request id, metadata) of the latest Inference calls, for tests of what clients send.
        self.received_metadata: deque[tuple[str, tuple[tuple[str, str | bytes], ...]]] = deque(
            maxlen=RECEIVED_METADATA
        )

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        config = self.config
        engines: list[RankEngine] = []
        if config.kv_events_port is not None:
            self._zmq = zmq.asyncio.Context()
        for rank in config.ranks:
            publisher = None
            endpoint = config.kv_endpoint(rank)
            if endpoint is not None and self._zmq is not None:
                publisher = KvEventPublisher(
                    context=self._zmq,
                    rank=rank,
                    endpoint=endpoint,
                    replay_endpoint=config.kv_replay_endpoint(rank),
                    topic=config.kv_events_topic,
                    buffer_steps=config.kv_replay_buffer_steps,
                    hwm=config.kv_events_hwm,
                    event_format=config.kv_event_format,
                )
                try:
                    publisher.open()
                except zmq.ZMQError:
                    # stop() knows no group yet: the ranks already started are closed here.
                    await _stop_engines(engines)
                    raise
            engine = RankEngine(rank, config, self.vocab, self.model, publisher)
            engine.start()
            engines.append(engine)
        self.group = DpGroup(engines)
        split = config.grpc_services == "split"
        self.faults = Faults(self.group, self.health, SPLIT_SERVICES if split else SERVICES)
        await self.faults.slow_start(config.startup_delay_s)

        server: grpc.aio.Server | H2Server
        if config.grpc_server == "inloop":
            server = H2Server(max_message=MAX_MESSAGE)
        else:
            server = grpc.aio.server(options=_GRPC_OPTIONS)
        # Both servers take the generated registrations, so one set of servicers serves both.
        inference_pb2_grpc.add_InferenceServicer_to_server(  # type: ignore[no-untyped-call]
            InferenceService(self), server
        )
        control_pb2_grpc.add_ControlServicer_to_server(  # type: ignore[no-untyped-call]
            ControlService(self), server
        )
        if split:
            kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(  # type: ignore[no-untyped-call]
                KvTransferService(self), server
            )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if isinstance(server, H2Server):
            self.port = await server.start(config.host, config.port)
        else:
            self.port = server.add_insecure_port(f"{config.host}:{config.port}")
            if self.port == 0:
                raise OSError(f"cannot listen on {config.host}:{config.port}")
            await server.start()
        self._server = server

    async def stop(self, grace: float | None = 0.2) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.faults is not None:
            await self.faults.close()
        if self.group is not None:
            await _stop_engines(self.group.engines.values())
        await self.media.close()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def submit(self, req: MockRequest, rank: int | None) -> tuple[RankEngine, EngineRequest]:
        assert self.group is not None
        assert self.faults is not None
        self.faults.check_admission()
        return self.group.submit(req, rank)


async def _stop_engines(engines: Iterable[RankEngine]) -> None:
    for engine in engines:
        await engine.stop()
        if engine.publisher is not None:
            await engine.publisher.close()


def _with_instance_id(config: MockEngineConfig) -> MockEngineConfig:
    from dataclasses import replace

    return replace(config, instance_id=uuid.uuid4().hex)


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, server: MockServer) -> None:
        self._server = server

    async def _prepare(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[RankEngine, EngineRequest]:
        metadata = context.invocation_metadata()
        self._server.received_metadata.append((request.request_id, tuple(metadata)))
        rank = parse_rank(metadata)
        prepared = await self._server.validator.validate(request)
        return self._server.submit(prepared, rank)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        try:
            engine, handle = await self._prepare(request, context)
        except RpcStatus as status:
            await context.abort(status.code, status.message)
        try:
            collected = await handle.outbox.take_all()
        except RpcStatus as status:
            await context.abort(status.code, status.message)
        finally:
            if not handle.outbox.finished:
                engine.abort(handle.request_id)
        garbled = self._garbled()
        if garbled is not None:
            return garbled  # type: ignore[return-value]
        response = inference_pb2.GenerateResponse(prompt_info=_prompt_info(handle, self._server))
        _fill_output(response.outputs, handle, collected)
        return response

    def _garbled(self) -> bytes | None:
        faults = self._server.faults
        return None if faults is None else faults.garbled_reply()

    async def GenerateStream(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        try:
            engine, handle = await self._prepare(request, context)
        except RpcStatus as status:
            await context.abort(status.code, status.message)
        outbox = handle.outbox
        try:
            yield inference_pb2.GenerateResponse(prompt_info=_prompt_info(handle, self._server))
            garbled = self._garbled()
            if garbled is not None:
                yield garbled  # type: ignore[misc]
            while True:
                try:
                    items = await outbox.take()
                except RpcStatus as status:
                    await context.abort(status.code, status.message)
                yield _delta(handle, items)
                if items[-1].finish is not Finish.NOT_FINISHED:
                    return
        finally:
            if not outbox.finished:
                engine.abort(handle.request_id)


def _prompt_info(handle: EngineRequest, server: MockServer) -> inference_pb2.PromptInfo:
    req = handle.req
    info = inference_pb2.PromptInfo(num_prompt_tokens=len(req.prompt))
    if req.shape.prompt_token_ids:
        info.token_ids.extend(req.prompt)
    if req.shape.prompt_logprobs:
        # As vLLM: a placeholder for the first token (0.0, rank 0, no candidates), then one
        # entry per token; candidates only when prompt_candidates asks for them.
        info.logprobs.append(0.0)
        info.ranks.append(0)
        info.candidate_tokens.add()
        scored = prompt_logprobs(
            server.model, req.prompt, req.lora, server.config.seed, req.shape.prompt_top_n
        )
        for entry in scored:
            info.logprobs.append(entry.logprob)
            info.ranks.append(entry.rank)
            candidates = info.candidate_tokens.add()
            for token_id, logprob, rank in entry.candidates:
                candidates.tokens.add(id=token_id, logprob=logprob, rank=rank)
    return info


def _delta(handle: EngineRequest, items: list[Emitted]) -> inference_pb2.GenerateResponse:
    """One streamed message: everything produced since the client's last read."""
    response = inference_pb2.GenerateResponse()
    _fill_output(response.outputs, handle, items)
    return response


def _fill_output(
    out: inference_pb2.SequenceOutput, handle: EngineRequest, items: list[Emitted]
) -> None:
    shape = handle.req.shape
    if len(items) == 1:
        last = items[0]
        tokens = [last.token_id] if last.token_id >= 0 else []
        text = last.text
    else:
        last = items[-1]
        tokens = [item.token_id for item in items if item.token_id >= 0]
        text = "".join(item.text for item in items)
    out.num_tokens = len(tokens)
    if shape.output_text:
        out.text = text
    if shape.output_token_ids:
        out.token_ids.extend(tokens)
    if shape.output_logprobs:
        for item in items:
            info = item.info
            if info is None:
                continue
            out.logprobs.append(info.logprob)
            out.ranks.append(info.rank)
            entry = out.candidate_tokens.add()
            for token_id, logprob, rank in info.candidates:
                entry.tokens.add(id=token_id, logprob=logprob, rank=rank)
    if last.finish is not Finish.NOT_FINISHED:
        finish = out.finish_info
        finish.num_output_tokens = handle.sequence.num_tokens
        finish.finish_reason = _FinishReason.Value(last.finish.name)
        if last.eos:
            finish.eos_token_id = last.token_id
        elif isinstance(last.stop_reason, str):
            finish.stop_string = last.stop_reason
        elif isinstance(last.stop_reason, int):
            finish.stop_token_id = last.stop_reason
        if handle.kv_transfer_out is not None:
            finish.kv_transfer_params.update(handle.kv_transfer_out)


_UNIMPLEMENTED = (
    "Shutdown",
    "LoadLora",
    "UnloadLora",
    "PauseGeneration",
    "ResumeGeneration",
    "IsPaused",
    "Sleep",
    "WakeUp",
    "IsSleeping",
    "InitWeightTransferEngine",
    "StartWeightUpdate",
    "StartDraftWeightUpdate",
    "UpdateWeights",
    "FinishWeightUpdate",
    "UpdateWeightVersion",
    "GetWeightVersion",
)


class ControlService(control_pb2_grpc.ControlServicer):
    def __init__(self, server: MockServer) -> None:
        self._server = server
        self._started = time.time()

    async def GetServerInfo(
        self, request: control_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ServerInfo:
        c = self._server.config
        return control_pb2.ServerInfo(
            engine_version=c.engine_version,
            api_version="vllm",
            instance_id=c.instance_id,
            parallelism=control_pb2.ParallelismInfo(
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_size=c.dp_size,
                data_parallel_rank=c.dp_start_rank,
                decode_context_parallel_size=1,
                world_size=1,
                data_parallel_size_local=c.local_size,
            ),
            max_model_len=c.max_model_len,
            kv_block_size=c.block_size,
            total_kv_blocks=c.blocks_per_rank * c.local_size,
            max_running_requests=c.max_running_requests,
            max_batched_tokens=c.max_batched_tokens,
            max_loras=c.max_loras or (len(c.loras) if c.loras else 0),
            rl_capabilities=control_pb2.RlCapabilities(),
            effective_attention_block_size=c.block_size,
        )

    async def GetModelInfo(
        self, request: control_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ModelInfo:
        c = self._server.config
        return control_pb2.ModelInfo(
            model_id=c.resolved_model_id,
            served_model_name=c.model,
            served_model_aliases=list(c.served_model_aliases),
            supports_text_input=c.supports_text_input and self._server.vocab.tokenizer is not None,
            supports_token_ids_input=True,
            supports_lora=bool(c.loras),
            supports_multimodal=self._server.media.policy is not None,
            reasoning_parser=c.reasoning_parser,
            tool_call_parser=c.tool_call_parser,
        )

    async def GetKvEventSources(
        self, request: control_pb2.GetKvEventSourcesRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.GetKvEventSourcesResponse:
        if self._server.config.grpc_services == "split":
            # Moved to vllm.KvTransfer, as `--grpc-services configured` answers on vLLM main.
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "GetKvEventSources is not implemented"
            )
        return kv_event_sources(self._server.config)

    async def Abort(
        self, request: control_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.AbortResponse:
        group = self._server.group
        if group is not None and request.request_ids:
            group.abort(list(request.request_ids))
        return control_pb2.AbortResponse()

    async def ListLoras(
        self, request: control_pb2.ListLorasRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ListLorasResponse:
        if not self._server.config.loras:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "engine was not started with LoRA enabled"
            )
        response = control_pb2.ListLorasResponse()
        for index, name in enumerate(sorted(self._server.config.loras), start=1):
            response.adapters.add(lora_id=index, lora_name=name, source_path=f"/mock/{name}")
        return response


def kv_event_sources(c: MockEngineConfig) -> control_pb2.GetKvEventSourcesResponse:
    """Each rank's KV-event publisher, as vLLM describes it."""
    response = control_pb2.GetKvEventSourcesResponse()
    for rank in c.ranks:
        endpoint = c.kv_endpoint(rank)
        if endpoint is None:
            continue
        response.sources.add(
            transport="zmq",
            endpoint=endpoint,
            topic=c.kv_events_topic,
            replay_endpoint=c.kv_replay_endpoint(rank) or "",
            data_parallel_rank=rank,
            encoding="msgpack",
            schema_version=1,
            buffer_steps=c.kv_replay_buffer_steps,
            hwm=c.kv_events_hwm,
            max_queue_size=100_000,
        )
    return response


class KvTransferService:
    """``vllm.KvTransfer`` of vLLM main's split layout: KV-event discovery moved off Control."""

    def __init__(self, server: MockServer) -> None:
        self._server = server

    async def GetKvEventSources(
        self, request: control_pb2.GetKvEventSourcesRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.GetKvEventSourcesResponse:
        return kv_event_sources(self._server.config)


def _unimplemented(name: str) -> Any:
    async def handler(self: ControlService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented")

    handler.__name__ = name
    return handler


for _name in _UNIMPLEMENTED:
    setattr(ControlService, _name, _unimplemented(_name))


async def serve_forever(config: MockEngineConfig) -> None:
    """Run until cancelled (the CLI's entry point)."""
    server = MockServer(config)
    await server.start()
    log.info(
        "mock vLLM engine %s serving %s on %s (ranks %s)",
        config.engine_version,
        config.model,
        server.target,
        list(config.ranks),
    )
    try:
        await server.wait_for_termination()
    finally:
        await server.stop()


__all__ = ["MockServer", "serve_forever"]
