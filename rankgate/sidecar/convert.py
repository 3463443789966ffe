"""PreparedRequest → ``vllm.GenerateRequest`` and ``vllm.GenerateResponse`` → Delta.

Both directions run on the hot path (per request, per token), so the parts of a request that
do not vary between requests are built once and reused, and the per-token decoder allocates
only the Delta it returns.

Choices that matter for correctness (SPEC.md section 3):

* temperature is always sent, because an absent temperature means greedy on vLLM;
* ``num_sequences`` is never set: OpenAI ``n`` is served by ``n`` requests, seeded
  ``seed + i`` so choices differ yet stay reproducible;
* text and token ids are always requested (routing and usage need the ids);
* the cache salt is sent as ``rankgate-salt:<salt>``. vLLM mixes the salt into the first
  block and reports it in that block's ``extra_keys`` beside LoRA names and image ids; the tag
  lets the KV-event intake tell the salt apart from those (SPEC.md section 7).
"""

from __future__ import annotations

import functools
from typing import Any

from rankgate.sidecar.errors import BadEngineResponse, EngineFailure, InvalidRequest
from rankgate.sidecar.routing.hashing import tagged_salt
from rankgate.sidecar.types import (
    Delta,
    FinishReason,
    MediaInput,
    OutputOptions,
    PreparedRequest,
    StoppingParams,
    StructuredOutput,
    TokenLogprob,
)
from rankgate.wire.proto.vllm import inference_pb2 as pb

_INT64_MAX = (1 << 63) - 1
_UINT64 = 1 << 64

_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FinishInfo.LENGTH: "length",
    pb.FinishInfo.STOP: "stop",
    pb.FinishInfo.ABORTED: "abort",
}


def is_decode_handoff(request: PreparedRequest) -> bool:
    """A disaggregated decode request: its KV arrives from a remote prefill, and dropping it
    before the first token can strand that transfer (SPEC.md section 8)."""
    params = request.kv_transfer_params
    return bool(params) and bool(params.get("do_remote_prefill"))  # type: ignore[union-attr]


class RequestEncoder:
    """Encodes prepared requests for one engine; ``model`` is the engine's own served name."""

    def __init__(self, model: str) -> None:
        self._model = model

    def encode(self, request: PreparedRequest) -> list[pb.GenerateRequest]:
        """One ``GenerateRequest`` per choice (ids ``<request_id>-<i>``).

        Raises InvalidRequest for anything vLLM could not accept, before any RPC is made.
        """
        if request.n < 1:
            raise InvalidRequest(f"n must be at least 1, got {request.n}", param="n")
        sampling = request.sampling
        seed = sampling.seed
        if seed is not None and not -_INT64_MAX - 1 <= seed <= _INT64_MAX:
            raise InvalidRequest(f"seed {seed} is outside the 64-bit signed range", param="seed")
        try:
            base = self._base(request)
            messages = [base]
            for _ in range(1, request.n):
                copy = pb.GenerateRequest()
                copy.CopyFrom(base)
                messages.append(copy)
            for choice, message in enumerate(messages):
                message.request_id = f"{request.request_id}-{choice}"
                choice_seed = None if seed is None else _wrap_int64(seed + choice)
                message.sampling.CopyFrom(
                    _sampling(sampling.top_k, sampling.top_p, sampling.min_p, choice_seed)
                )
            return messages
        except (ValueError, TypeError, OverflowError) as error:
            raise InvalidRequest(f"request cannot be encoded for the engine: {error}") from None

    def _base(self, request: PreparedRequest) -> pb.GenerateRequest:
        """Everything the choices share. The prompt is written into the message in place:
        building a ``TokenIds`` first would copy every token id twice."""
        message = pb.GenerateRequest(
            model=self._model,
            temperature=request.sampling.temperature,
            stopping=_stopping(request.stopping),
            response=_response(request.output),
            priority=request.priority,
            lora_name=request.lora_name or "",
        )
        if request.prompt_token_ids:
            message.token_ids.ids.extend(request.prompt_token_ids)
        elif request.media:
            raise InvalidRequest("images require a token-id prompt")
        elif request.prompt_text:
            message.text = request.prompt_text
        else:
            raise InvalidRequest("the prompt is empty")
        decoding = _decoding(request)
        if decoding is not None:
            message.decoding.CopyFrom(decoding)
        if request.cache_salt:
            message.kv.cache_salt = tagged_salt(request.cache_salt)
        if request.kv_transfer_params:
            encode_transfer_params(message.kv.kv_transfer_params, request.kv_transfer_params)
        if request.media:
            message.media.extend(_media(item) for item in request.media)
        return message


def _wrap_int64(value: int) -> int:
    return value - _UINT64 if value > _INT64_MAX else value


@functools.lru_cache(maxsize=256)
def _sampling(top_k: int, top_p: float, min_p: float, seed: int | None) -> pb.RandomSampling:
    # Cached: most requests share a handful of sampling settings. Messages passed to a
    # constructor are copied, so sharing the cached instance is safe.
    message = pb.RandomSampling(top_k=top_k, top_p=top_p, min_p=min_p)
    if seed is not None:
        message.seed = seed
    return message


@functools.lru_cache(maxsize=256)
def _stopping(stopping: StoppingParams) -> pb.StoppingCriteria:
    return pb.StoppingCriteria(
        max_new_tokens=stopping.max_tokens,
        min_new_tokens=stopping.min_tokens,
        stop_token_ids=stopping.stop_token_ids,
        stop_strings=stopping.stop,
        include_stop_strings=stopping.include_stop_str_in_output,
        ignore_eos=stopping.ignore_eos,
    )


@functools.lru_cache(maxsize=64)
def _response(output: OutputOptions) -> pb.ResponseOptions:
    message = pb.ResponseOptions(
        # Prompt logprobs are paired with the engine's own prompt ids (images expanded).
        prompt_token_ids=output.prompt_token_ids or output.prompt_logprobs is not None,
        output_text=True,
        output_token_ids=True,
        skip_special_tokens=output.skip_special_tokens,
    )
    if output.logprobs is not None:
        if output.logprobs < 0:
            raise InvalidRequest(
                f"logprobs must not be negative, got {output.logprobs}", param="logprobs"
            )
        message.output_logprobs = True
        if output.logprobs > 0:
            message.output_candidates.top_n = output.logprobs
    if output.prompt_logprobs is not None:
        if output.prompt_logprobs < 0:
            raise InvalidRequest(
                f"prompt_logprobs must not be negative, got {output.prompt_logprobs}",
                param="prompt_logprobs",
            )
        message.prompt_logprobs = True
        if output.prompt_logprobs > 0:
            message.prompt_candidates.top_n = output.prompt_logprobs
    return message


def _decoding(request: PreparedRequest) -> pb.DecodingParameters | None:
    sampling = request.sampling
    structured = request.structured
    if not (
        sampling.presence_penalty
        or sampling.frequency_penalty
        or sampling.repetition_penalty
        or sampling.logit_bias
        or sampling.allowed_token_ids
        or structured is not None
    ):
        return None
    message = pb.DecodingParameters(
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=sampling.logit_bias or {},
        allowed_token_ids=sampling.allowed_token_ids,
    )
    if structured is not None:
        _structured(message, structured)
    return message


def _structured(message: pb.DecodingParameters, structured: StructuredOutput) -> None:
    kind = structured.kind
    if kind == "json_object":
        message.json_object = True
    elif kind == "choice":
        if not structured.choices:
            raise InvalidRequest("a choice constraint needs at least one choice")
        message.choice.choices.extend(structured.choices)
    elif not structured.spec:
        raise InvalidRequest(f"the {kind} constraint is empty")
    elif kind == "json":
        message.json = structured.spec
    elif kind == "regex":
        message.regex = structured.spec
    elif kind == "grammar":
        message.grammar = structured.spec
    elif kind == "structural_tag":
        message.structural_tag = structured.spec
    else:
        raise InvalidRequest(f"unknown structured output kind {kind!r}")


_MODALITIES = {
    "image": pb.MODALITY_IMAGE,
    "audio": pb.MODALITY_AUDIO,
    "video": pb.MODALITY_VIDEO,
}


def _media(item: MediaInput) -> pb.MediaItem:
    if not item.uuid:
        raise InvalidRequest(f"every {item.modality} needs a content identity (uuid)")
    modality = _MODALITIES[item.modality]
    if item.data is not None:
        return pb.MediaItem(
            modality=modality, raw_bytes=item.data, mime_type=item.mime_type, uuid=item.uuid
        )
    if item.url:
        return pb.MediaItem(
            modality=modality, url=item.url, mime_type=item.mime_type, uuid=item.uuid
        )
    raise InvalidRequest(f"{item.modality} {item.uuid} has neither bytes nor a URL")


def encode_transfer_params(target: Any, params: dict[str, Any]) -> None:
    """Fill the ``google.protobuf.Struct`` ``target`` with ``params`` in their JSON types.

    Struct numbers are doubles, so ``remote_port`` arrives as ``5600.0``; vLLM's NIXL connector
    accepts that, but not strings where it compares sizes (``dcp_size``), so numbers are never
    turned into strings (observed on vLLM 0.32)."""
    target.update(params)


def decode_transfer_params(message: Any) -> dict[str, Any]:
    """``google.protobuf.Struct`` → dict, integral doubles read back as ints (a port that came
    as 8000.0 is 8000 to the gateway; it goes out as a number again)."""
    return {key: _value(value) for key, value in message.fields.items()}


def _value(value: Any) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return decode_transfer_params(value.struct_value)
    if kind == "list_value":
        return [_value(item) for item in value.list_value.values]
    return None


def merge_responses(into: pb.GenerateResponse, more: list[pb.GenerateResponse]) -> bool:
    """Append every message of ``more`` to ``into`` (True), or none of them: text deltas
    concatenate, token ids extend, the finish carries over, as vLLM's own output collector
    merges the outputs a slow consumer has not taken yet. Declined when ``into`` is finished,
    or when a message of ``more`` starts a stream or follows a finish.

    Only for streams that asked for no logprobs (``wants_logprobs``): their per-token lists
    would need aligning. A field access on a message costs far more than on a plain object,
    so the repeated fields are joined by ``MergeFrom`` and the text is set once.
    """
    out = into.outputs
    if out.HasField("finish_info"):
        return False
    texts = [out.text]
    count = out.num_tokens
    finished = False
    for message in more:
        if finished or message.HasField("prompt_info"):
            return False
        add = message.outputs
        texts.append(add.text)
        count += add.num_tokens
        finished = add.HasField("finish_info")
    for message in more:
        into.MergeFrom(message)
    out.text = "".join(texts)
    out.num_tokens = count
    return True


def wants_logprobs(request: pb.GenerateRequest) -> bool:
    """Whether the engine will send per-token logprob lists for ``request``."""
    response = request.response
    return bool(response.output_logprobs or response.HasField("output_candidates"))


class DeltaDecoder:
    """Turns one engine stream's responses into deltas for choice ``index``.

    The first message of a vLLM stream carries only ``prompt_info``; its counts ride on the
    choice's first real delta instead of producing an empty delta of their own.
    """

    __slots__ = (
        "_first",
        "_prompt_logprobs",
        "_prompt_token_ids",
        "_prompt_tokens",
        "_want_logprobs",
        "index",
    )

    def __init__(self, index: int, want_logprobs: bool) -> None:
        self.index = index
        self._want_logprobs = want_logprobs
        # vLLM sets ``prompt_info`` on a stream's first message only (SPEC.md); a field test
        # on a message costs a lookup by name, so later messages are not asked.
        self._first = True
        self._prompt_tokens: int | None = None
        self._prompt_token_ids: tuple[int, ...] | None = None
        self._prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def feed(self, response: pb.GenerateResponse) -> Delta | None:
        """The delta this response contributes, or None when it carries nothing to emit yet."""
        # Repeated fields are copied by slicing, in one call: iterating one ends in an
        # IndexError whose message is formatted and dropped, once per message.
        if self._first and response.HasField("prompt_info"):
            info = response.prompt_info
            self._prompt_tokens = info.num_prompt_tokens
            prompt_ids = info.token_ids[:]
            if prompt_ids:
                self._prompt_token_ids = tuple(prompt_ids)
            if info.logprobs:
                self._prompt_logprobs = prompt_logprobs(info)
        self._first = False
        output = response.outputs
        token_ids = output.token_ids[:]
        text = output.text
        finished = output.HasField("finish_info")
        if not token_ids and not text and not finished:
            return None
        delta = Delta(index=self.index, text=text, token_ids=tuple(token_ids))
        if self._prompt_tokens is not None:
            delta.prompt_tokens = self._prompt_tokens
            delta.prompt_token_ids = self._prompt_token_ids
            delta.prompt_logprobs = self._prompt_logprobs
            self._prompt_tokens = None
            self._prompt_token_ids = None
            self._prompt_logprobs = None
        if self._want_logprobs and token_ids:
            delta.logprobs = _logprobs(output)
        if finished:
            _finish(delta, output.finish_info)
        return delta


def _logprobs(output: pb.SequenceOutput) -> tuple[TokenLogprob, ...]:
    logprobs = output.logprobs[:]
    ranks = output.ranks[:]
    candidates = output.candidate_tokens[:]
    result = []
    for position, token_id in enumerate(output.token_ids[:]):
        top: tuple[tuple[int, float, int], ...] = ()
        if position < len(candidates):
            top = tuple((t.id, t.logprob, t.rank) for t in candidates[position].tokens[:])
        result.append(
            TokenLogprob(
                token_id,
                logprobs[position] if position < len(logprobs) else float("nan"),
                ranks[position] if position < len(ranks) else 0,
                top,
            )
        )
    return tuple(result)


def prompt_logprobs(info: pb.PromptInfo) -> tuple[TokenLogprob | None, ...]:
    """The prompt's logprobs, paired with its token ids; the first token's is None.

    vLLM sends a placeholder for the first token (logprob 0.0, rank 0, no candidates): nothing
    precedes it to score it, and vLLM's OpenAI server answers null there.
    """
    token_ids = info.token_ids[:]
    logprobs = info.logprobs[:]
    ranks = info.ranks[:]
    candidates = info.candidate_tokens[:]
    if len(logprobs) != len(token_ids) or len(ranks) != len(token_ids):
        raise BadEngineResponse(
            f"the engine sent {len(logprobs)} prompt logprobs and {len(ranks)} ranks for "
            f"{len(token_ids)} prompt tokens"
        )
    result: list[TokenLogprob | None] = [None]
    for position in range(1, len(token_ids)):
        top: tuple[tuple[int, float, int], ...] = ()
        if position < len(candidates):
            top = tuple((t.id, t.logprob, t.rank) for t in candidates[position].tokens[:])
        result.append(TokenLogprob(token_ids[position], logprobs[position], ranks[position], top))
    return tuple(result)


def _finish(delta: Delta, finish: pb.FinishInfo) -> None:
    reason = _FINISH_REASONS.get(finish.finish_reason)
    if reason is None:
        raise EngineFailure("engine finished a sequence without a finish reason")
    delta.finish_reason = reason
    delta.completion_tokens = finish.num_output_tokens
    which = finish.WhichOneof("stop_reason")
    if which == "stop_token_id":
        delta.stop_reason = finish.stop_token_id
    elif which == "stop_string":
        delta.stop_reason = finish.stop_string
    # An EOS stop has no stop_reason, as in vLLM's OpenAI server.
    if finish.HasField("kv_transfer_params"):
        delta.kv_transfer_params = decode_transfer_params(finish.kv_transfer_params)
