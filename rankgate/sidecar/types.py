"""Typed values that cross the rankgate/app/sidecar boundary.

The app builds a :class:`PreparedRequest` from an OpenAI request; the sidecar answers with a
stream of :class:`Delta`. Discovery produces :class:`EngineInfo`. Keeping these small, frozen
and free of gRPC types lets each side change its internals without the other noticing.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import msgspec

FinishReason = Literal["stop", "length", "abort"]
StructuredKind = Literal["json", "regex", "choice", "grammar", "json_object", "structural_tag"]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling knobs. Zero means "engine default" for the fields vLLM treats that way."""

    temperature: float
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] = ()


class StoppingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False


class OutputOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine should return besides text.

    ``logprobs`` is None for none, 0 for the sampled token's logprob only, k for k candidates.
    ``prompt_logprobs`` asks the same of every prompt token (the engine's prefill computes
    them; they cannot be recomputed afterwards), and implies the prompt's token ids.
    """

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_token_ids: bool = False
    skip_special_tokens: bool = True


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    kind: StructuredKind
    # JSON schema text, regex, grammar or structural tag; the choices for ``choice``.
    spec: str = ""
    choices: tuple[str, ...] = ()


class MediaInput(msgspec.Struct, frozen=True, kw_only=True):
    """One image, audio clip or video ready for vLLM: its bytes or a URL vLLM fetches itself.

    ``uuid`` is the content identity shared by vLLM's caches and our router; ``num_tokens`` is
    how many prompt tokens the item expands to, when known.
    """

    uuid: str
    mime_type: str = ""
    data: bytes | None = None
    url: str | None = None
    num_tokens: int | None = None
    # Index of this item's placeholder token in ``prompt_token_ids``, when the app knows it:
    # lets the router expand the item in place and match the blocks it fills.
    position: int | None = None
    modality: Literal["image", "audio", "video"] = "image"
    # The exact tokens vLLM makes of the placeholder, when they are not ``num_tokens`` copies of
    # it (Qwen3-VL writes each frame's timestamp and markers into a video's expansion): the
    # router hashes these, so it matches the blocks vLLM stores.
    expansion: tuple[int, ...] | None = None


Metadata = tuple[tuple[str, str], ...]


class EngineCallTrace(Protocol):
    """The span of one engine call (one choice on one rank)."""

    @property
    def metadata(self) -> Metadata:
        """What the call sends for the trace to continue in vLLM (``traceparent``, ...)."""

    def end(self, error: str | None = None) -> None:
        """The call ended (with ``error`` when it failed); later calls do nothing."""


class RequestTrace(Protocol):
    """Tracing of one request's steps inside the sidecar, supplied by the app when tracing
    is on (``PreparedRequest.trace``); the sidecar never sees the tracing library."""

    def admission(self, waited: bool, start_ns: int, error: str | None = None) -> None:
        """Admission let the request through (or refused it), ``start_ns`` to now."""

    def routed(
        self,
        choice: int,
        rank: int | None,
        cached_tokens: int,
        prompt_tokens: int,
        policy: str,
        reason: str,
        start_ns: int,
    ) -> None:
        """The router chose ``rank`` for ``choice``, ``start_ns`` to now."""

    def engine_call(self, choice: int, rank: int | None, method: str) -> EngineCallTrace:
        """An engine call begins now."""


class PreparedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A fully validated, tokenized request, independent of the OpenAI endpoint it came from.

    ``n`` choices are served by fanning out ``n`` engine requests (vLLM rejects
    ``num_sequences > 1``); ``rank`` pins a data-parallel rank chosen by the client.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] = ()
    prompt_text: str | None = None
    sampling: SamplingParams
    stopping: StoppingParams
    output: OutputOptions = OutputOptions()
    structured: StructuredOutput | None = None
    n: int = 1
    cache_salt: str | None = None
    priority: int = 0
    lora_name: str | None = None
    media: tuple[MediaInput, ...] = ()
    kv_transfer_params: dict[str, Any] | None = None
    rank: int | None = None
    # The conversation the client named (``prompt_cache_key``, a Responses chain, an
    # operator's session header): the router sends it where its earlier turns went, before
    # any KV event says so, as long as that rank's load allows.
    affinity: str | None = None
    # False when the caller wants only the finished output (a non-streaming response): the
    # sidecar may then answer each choice with one whole-output delta from a unary call.
    stream: bool = True
    # None unless tracing is on: spans for admission, routing and each engine call, whose
    # trace context the engine calls carry as metadata.
    trace: RequestTrace | None = None


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    rank: int
    # (token_id, logprob, rank) of the top candidates at this position.
    top: tuple[tuple[int, float, int], ...] = ()


class Delta(msgspec.Struct, kw_only=True, gc=False):
    """One step of one choice's output.

    Not tracked by the garbage collector (``gc=False``): one is made per token, and none
    can be part of a reference cycle (it holds numbers, strings, tuples and JSON values).

    The first delta of each choice carries ``prompt_tokens`` (vLLM's count, which includes the
    expanded image tokens); the last carries ``finish_reason`` and ``completion_tokens``.
    """

    index: int = 0
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    # On a choice's first delta, when asked for: one entry per prompt token (of the expanded
    # prompt, as the engine saw it), None for the first, which has no context to score it.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    completion_tokens: int | None = None
    finish_reason: FinishReason | None = None
    # The stop string or token id that ended the choice, as vLLM reports it.
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # On a choice's first delta: the DP rank it was pinned to (None: vLLM chose) and the
    # prompt tokens the router believed that rank held already.
    rank: int | None = None
    cached_tokens: int | None = None
    # On a choice's first delta: the router's decision as one header value (``RouteDecision
    # .header()``), which the app returns as ``x-rankgate-route`` for debugging.
    route: str | None = None


class DeltaSink(Protocol):
    """Where a streamed choice's deltas go when its consumer takes them straight from the
    engine connection's callback, without waking its task for each one.

    A consumer sends one into :meth:`Sidecar.generate`'s stream (``asend``). From then on a
    delta that neither starts nor ends the choice is handed to :meth:`put` while :meth:`ready`
    holds, in order; every other delta, and every one while it does not hold, is yielded as
    before. ``put`` must take the delta whole: it runs inside the connection's callback.
    """

    def ready(self) -> bool:
        """Whether :meth:`put` would hand a delta on right now."""

    def put(self, delta: Delta) -> None:
        """Take one delta; an exception ends the stream as the same failure yielded would."""


class RankCapacity(msgspec.Struct, frozen=True):
    rank: int
    kv_blocks: int
    max_running_requests: int


class KvEventSource(msgspec.Struct, frozen=True):
    """A validated ZMQ KV-event publisher for one DP rank."""

    rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    # vLLM's publisher connects to ``endpoint`` rather than binding it (a concrete host, not
    # ``*``/``::``/ipc/inproc): the subscriber must then bind that address itself.
    bind: bool = False


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What discovery learnt about the engine; compared across passes to catch drift."""

    model_id: str
    served_model_name: str
    aliases: tuple[str, ...]
    engine_version: str
    instance_id: str
    max_model_len: int
    block_size: int
    dp_size: int
    ranks: tuple[int, ...]
    capacity: tuple[RankCapacity, ...]
    max_batched_tokens: int
    supports_text_input: bool
    supports_lora: bool
    supports_multimodal: bool
    reasoning_parser: str
    tool_call_parser: str
    kv_event_sources: tuple[KvEventSource, ...] = ()
