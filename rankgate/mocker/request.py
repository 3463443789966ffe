"""Validation of a ``GenerateRequest``, in vLLM's order and with vLLM's messages.

The result, :class:`MockRequest`, is everything the engine needs and nothing from protobuf,
so the scheduler never touches wire types.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

from rankgate.mocker import structured
from rankgate.mocker.config import MockEngineConfig
from rankgate.mocker.media import MediaResolver, MediaSpan
from rankgate.mocker.model import Processing
from rankgate.mocker.output import LogprobSpec, SamplingSpec, context_key, sample_seed
from rankgate.mocker.status import failed_precondition, invalid_argument, not_found
from rankgate.mocker.transfer import check as check_transfer
from rankgate.mocker.vocab import Vocabulary
from rankgate.wire.proto.vllm import inference_pb2

RANK_METADATA_KEY = "x-data-parallel-rank"
_RANK_ERROR = "x-data-parallel-rank metadata must be an unsigned 32-bit integer"


@dataclass(frozen=True, slots=True)
class ResponseShape:
    prompt_token_ids: bool
    prompt_logprobs: bool
    # Candidates per prompt position (``prompt_candidates.top_n``), with prompt_logprobs only.
    prompt_top_n: int
    output_text: bool
    output_token_ids: bool
    output_logprobs: bool


@dataclass(frozen=True, slots=True)
class MockRequest:
    request_id: str
    prompt: list[int]
    spec: SamplingSpec
    shape: ResponseShape
    lora: str
    cache_salt: str
    media: tuple[MediaSpan, ...]
    bypass_prefix_cache: bool
    kv_transfer_params: dict[str, Any] | None


def parse_rank(metadata: tuple[tuple[str, str | bytes], ...] | None) -> int | None:
    """The pinned DP rank from request metadata; absent means "let the balancer choose"."""
    for key, value in metadata or ():
        if key != RANK_METADATA_KEY:
            continue
        if isinstance(value, bytes):
            try:
                value = value.decode("ascii")
            except UnicodeDecodeError:
                raise invalid_argument(_RANK_ERROR) from None
        text = value.strip()
        if not text.isdigit() or int(text) > 0xFFFFFFFF:
            raise invalid_argument(_RANK_ERROR)
        return int(text)
    return None


class RequestValidator:
    """Turns wire requests into :class:`MockRequest`; shared by every RPC, built once."""

    def __init__(self, config: MockEngineConfig, vocab: Vocabulary, media: MediaResolver) -> None:
        self._config = config
        self._vocab = vocab
        self._media = media
        self._served = frozenset(config.served_names)
        self._loras = frozenset(config.loras)

    async def validate(self, req: inference_pb2.GenerateRequest) -> MockRequest:
        config = self._config
        if req.model and req.model not in self._served:
            raise not_found(f"model `{req.model}` not found")
        request_id = req.request_id or str(uuid.uuid4())
        prompt_kind = req.WhichOneof("prompt")
        if prompt_kind is None:
            raise invalid_argument("prompt is required")
        if req.sampling.num_sequences > 1:
            raise invalid_argument("num_sequences > 1 is not supported")
        kind = req.decoding.WhichOneof("structured_output")
        if kind is not None:
            structured.validate(kind, getattr(req.decoding, kind))
        shape = _shape(req)
        if shape.prompt_logprobs and req.response.prompt_candidates.WhichOneof("select") == (
            "token_ids"
        ):
            raise invalid_argument("prompt_candidates token_ids selector is not supported")
        lora = req.lora_name
        if lora:
            if not self._loras:
                raise failed_precondition("engine was not started with LoRA enabled")
            if lora not in self._loras:
                raise not_found(f"LoRA adapter `{lora}` is not loaded")

        if prompt_kind == "text":
            if req.media:
                raise invalid_argument("multimodal gRPC requests must provide token_ids input")
            if not config.supports_text_input or self._vocab.tokenizer is None:
                raise invalid_argument(
                    "text prompts are not supported: this server takes token_ids only"
                )
            prompt = self._vocab.encode(req.text)
        else:
            prompt = list(req.token_ids.ids)
        if not prompt:
            raise invalid_argument(
                f"text request `{request_id}` must contain at least one prompt token ID"
            )
        if max(prompt) >= self._vocab.size:
            too_big = [t for t in prompt if t >= self._vocab.size]
            raise invalid_argument(
                f"token_id(s) {too_big} in prompt are out of vocabulary. "
                f"Vocabulary size: {self._vocab.size}"
            )
        if req.truncate_prompt_tokens and len(prompt) > req.truncate_prompt_tokens:
            if req.media:
                raise invalid_argument(
                    "truncate_prompt_tokens is not supported for multimodal requests"
                )
            prompt = prompt[-req.truncate_prompt_tokens :]
        media: tuple[MediaSpan, ...] = ()
        if req.media:
            prompt, media = await self._media.expand(prompt, list(req.media), lora)
        if len(prompt) > config.max_model_len:
            raise invalid_argument(
                f"this model's maximum context length is {config.max_model_len} tokens, "
                f"but the prompt contains {len(prompt)} input tokens"
            )
        spec = self._sampling(req, request_id, prompt, lora, shape)
        kv_params: dict[str, Any] | None = None
        if req.kv.HasField("kv_transfer_params"):
            kv_params = struct_to_dict(req.kv.kv_transfer_params)
        check_transfer(config.role, kv_params, prompt, media, lora, req.kv.cache_salt)
        return MockRequest(
            request_id=request_id,
            prompt=prompt,
            spec=spec,
            shape=shape,
            lora=lora,
            cache_salt=req.kv.cache_salt,
            media=media,
            bypass_prefix_cache=req.kv.bypass_prefix_cache,
            kv_transfer_params=kv_params,
        )

    def _sampling(
        self,
        req: inference_pb2.GenerateRequest,
        request_id: str,
        prompt: list[int],
        lora: str,
        shape: ResponseShape,
    ) -> SamplingSpec:
        stopping = req.stopping
        room = self._config.max_model_len - len(prompt)
        max_tokens = min(stopping.max_new_tokens, room) if stopping.max_new_tokens else room
        min_tokens = stopping.min_new_tokens
        if stopping.max_new_tokens and min_tokens > stopping.max_new_tokens:
            raise invalid_argument(
                "`min_tokens` must be less than or equal to `max_tokens`, "
                f"got min_tokens={min_tokens}, max_tokens={stopping.max_new_tokens}"
            )
        stop_strings = stopping.stop_strings
        if stop_strings and not all(stop_strings):
            raise invalid_argument(f"text request `{request_id}` stop strings cannot be empty")
        stop_ids = stopping.stop_token_ids
        if stop_ids and max(stop_ids) >= self._vocab.size:
            bad_stops = [t for t in stop_ids if t >= self._vocab.size]
            raise invalid_argument(
                f"token_id(s) {bad_stops} in stop_token_ids are out of vocabulary. "
                f"Vocabulary size: {self._vocab.size}"
            )
        logprobs = self._logprobs(req) if shape.output_logprobs else None
        temperature = req.temperature if req.HasField("temperature") else 0.0
        sampling = req.sampling
        seed = sampling.seed if sampling.HasField("seed") else None
        logit_bias, allowed = self._token_constraints(req.decoding)
        key = context_key(prompt, lora, self._config.seed)
        seed_bytes = sample_seed(key, seed)
        return SamplingSpec(
            context_key=key,
            sample_seed=seed_bytes,
            processing=Processing(
                temperature=max(temperature, 0.0),
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                min_p=sampling.min_p,
                logit_bias=logit_bias,
                allowed=allowed,
            ),
            max_tokens=max(max_tokens, 0),
            min_tokens=min_tokens,
            stop_token_ids=frozenset(stop_ids),
            stop_strings=tuple(stop_strings),
            include_stop_strings=stopping.include_stop_strings,
            ignore_eos=stopping.ignore_eos,
            skip_special_tokens=(
                req.response.skip_special_tokens
                if req.response.HasField("skip_special_tokens")
                else True
            ),
            logprobs=logprobs,
            want_text=shape.output_text,
            eos_probability=self._config.eos_probability,
            forced=self._forced(req, seed_bytes),
        )

    def _logprobs(self, req: inference_pb2.GenerateRequest) -> LogprobSpec:
        """Which logprobs each output token carries; the sampled token's alone when the
        request names no candidates."""
        candidates = req.response.output_candidates
        select = (
            candidates.WhichOneof("select") if req.response.HasField("output_candidates") else None
        )
        if select == "top_n":
            return LogprobSpec(top_n=candidates.top_n)
        if select == "token_ids" and candidates.token_ids.ids:
            return LogprobSpec(token_ids=tuple(candidates.token_ids.ids))
        if select == "all" and candidates.all:
            return LogprobSpec(top_n=min(self._vocab.size, 20))
        return LogprobSpec()

    def _token_constraints(
        self, decoding: inference_pb2.DecodingParameters
    ) -> tuple[dict[int, float], frozenset[int] | None]:
        """The logit bias and the allowed tokens, refused as vLLM refuses them when they name
        a token outside the vocabulary."""
        vocab_size = self._vocab.size
        logit_bias = dict(decoding.logit_bias)
        if logit_bias and max(logit_bias) >= vocab_size:
            bad_bias = [t for t in logit_bias if t >= vocab_size]
            raise invalid_argument(
                f"token_id(s) {bad_bias} in logit_bias are out of vocabulary. "
                f"Vocabulary size: {vocab_size}"
            )
        allowed = frozenset(decoding.allowed_token_ids) if decoding.allowed_token_ids else None
        if allowed is not None and any(t >= vocab_size for t in allowed):
            raise invalid_argument(
                f"token_id(s) {sorted(t for t in allowed if t >= vocab_size)} in "
                f"allowed_token_ids are out of vocabulary. Vocabulary size: {vocab_size}"
            )
        return logit_bias, allowed

    def _forced(self, req: inference_pb2.GenerateRequest, seed: bytes) -> tuple[int, ...] | None:
        kind = req.decoding.WhichOneof("structured_output")
        if kind is None or (kind == "json_object" and not req.decoding.json_object):
            return None
        if self._vocab.tokenizer is None:
            raise invalid_argument("structured output needs a tokenizer-backed model")
        text = structured.target_text(kind, getattr(req.decoding, kind), random.Random(seed))
        return tuple(self._vocab.tokenizer.encode(text, add_special_tokens=False).ids)


_SAFE_INT = float(2**53 - 1)


def struct_to_dict(struct: Any) -> dict[str, Any]:
    """A ``google.protobuf.Struct`` as plain Python; integral numbers come back as ints."""
    return {key: _value(value) for key, value in struct.fields.items()}


def _value(value: Any) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() and abs(number) <= _SAFE_INT else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return struct_to_dict(value.struct_value)
    if kind == "list_value":
        return [_value(item) for item in value.list_value.values]
    return None


def _shape(req: inference_pb2.GenerateRequest) -> ResponseShape:
    if not req.HasField("response"):
        return ResponseShape(False, False, 0, True, False, False)
    r = req.response
    top_n = 0
    if r.prompt_logprobs and r.prompt_candidates.WhichOneof("select") == "top_n":
        top_n = r.prompt_candidates.top_n
    return ResponseShape(
        prompt_token_ids=r.prompt_token_ids,
        prompt_logprobs=r.prompt_logprobs,
        prompt_top_n=top_n,
        output_text=r.output_text if r.HasField("output_text") else True,
        output_token_ids=r.output_token_ids,
        output_logprobs=r.output_logprobs,
    )
