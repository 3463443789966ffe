"""OpenAI sampling, stopping and structured-output fields → the sidecar's typed parameters.

Both endpoints share these rules, so they live here once: defaults follow OpenAI (temperature
1.0 is always sent, because vLLM reads a missing temperature as greedy), vLLM's "0 means
engine default" is used for everything else, and every conflicting or unusable combination is
a 400 naming the field.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection
from operator import attrgetter
from typing import Any

import orjson

from rankgate.app.edge.limits import InputLimits, check_json_text
from rankgate.app.errors import ApiError, invalid, unsupported
from rankgate.app.schemas.requests import (
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingFields,
)
from rankgate.sidecar import SamplingParams, StoppingParams, StructuredOutput

log = logging.getLogger(__name__)

_REFUSED_COMMON = (
    ("use_beam_search", "is not supported: beam search is not offered by this gateway"),
    ("bad_words", "is not supported"),
    ("logits_processors", "is not supported"),
    ("vllm_xargs", "is not supported"),
)


_NONE_OR_BOOL = frozenset({type(None), bool})


@functools.cache
def _refused(extra: tuple[tuple[str, str], ...]) -> tuple[tuple[tuple[str, str], ...], Any]:
    """Each endpoint's refused fields, and one getter that reads them all in a C call."""
    fields = (*_REFUSED_COMMON, *extra)
    return fields, attrgetter(*(name for name, _ in fields))


def refuse_unsupported(req: SamplingFields, extra: tuple[tuple[str, str], ...] = ()) -> None:
    """Known-but-refused fields: set to anything but null/false, they are a 400 naming them."""
    fields, values = _refused(extra)
    got = values(req)
    # Whether every one is None or False, in C; the loop only names the one that is not.
    if not set(map(type, got)) <= _NONE_OR_BOOL or True in got:
        for value, (name, why) in zip(got, fields, strict=True):
            if value is not None and value is not False:
                raise unsupported(name, why)
    if req.stream_options is not None and not req.stream:
        raise invalid(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
        )


# The most candidates vLLM returns per position (its default ``max_logprobs``).
MAX_LOGPROBS = 20


def prompt_logprobs_of(req: SamplingFields, *, default: int | None = None) -> int | None:
    """How many candidates to return per prompt token (None: no prompt logprobs), as vLLM
    reads ``prompt_logprobs``; ``default`` stands in when the field is absent (completions'
    ``echo`` with ``logprobs``)."""
    value = req.prompt_logprobs
    if value is None:
        return default
    if value == -1:
        raise unsupported(
            "prompt_logprobs",
            "-1 (every token of the vocabulary, per prompt token) is not supported; "
            f"ask for at most {MAX_LOGPROBS}",
        )
    if not 0 <= value <= MAX_LOGPROBS:
        raise invalid(
            f"'prompt_logprobs' must be between 0 and {MAX_LOGPROBS}, got {value}",
            "prompt_logprobs",
        )
    if req.stream:
        # vLLM's own rule and message: prompt logprobs come only in a whole response.
        raise invalid("prompt_logprobs are not available when stream=true.", "prompt_logprobs")
    return value


def check_token_ids(
    ids: Collection[int], vocab_size: int, param: str, *, a_set: bool = False
) -> None:
    """A 400 for an id outside the vocabulary. ``a_set`` (ids that each name a token once
    over, like ``logit_bias``): more ids than the vocabulary has are refused before any is
    looked at, since each is also sent to the engine one by one."""
    if a_set and len(ids) > vocab_size:
        raise invalid(
            f"'{param}' lists {len(ids)} token ids, more than the vocabulary's {vocab_size}",
            param,
        )
    if max(ids, default=-1) < vocab_size:
        return
    for token in ids:
        if token >= vocab_size:
            raise invalid(
                f"token id {token} in '{param}' is out of vocabulary (size {vocab_size})", param
            )


def sampling_params(req: SamplingFields, vocab_size: int) -> SamplingParams:
    if req.logit_bias:
        check_token_ids(req.logit_bias, vocab_size, "logit_bias", a_set=True)
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise invalid("'allowed_token_ids' must not be empty", "allowed_token_ids")
        check_token_ids(req.allowed_token_ids, vocab_size, "allowed_token_ids", a_set=True)
    top_k = req.top_k or 0
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=req.top_p or 0.0,
        top_k=0 if top_k < 0 else top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 0.0,
        logit_bias=dict(req.logit_bias) if req.logit_bias else None,
        allowed_token_ids=tuple(req.allowed_token_ids or ()),
    )


def stop_strings(req: SamplingFields) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    for i, stop in enumerate(stops):
        if not stop:
            raise invalid("stop strings must not be empty", f"stop[{i}]" if i else "stop")
    return stops


def refuse_unfitting_text(chars: int, max_model_len: int, prompt_param: str) -> ApiError:
    """The context-length error for a prompt whose text alone is known to be too long."""
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt's text is {chars} characters, more than that many tokens can hold. Please "
        f"reduce the length of '{prompt_param}'.",
        param=prompt_param,
        code="context_length_exceeded",
    )


def check_context(prompt_len: int, requested: int, max_model_len: int) -> None:
    """vLLM's 400 for a prompt and ``max_tokens`` that together exceed the context."""
    if prompt_len + requested > max_model_len:
        raise ApiError(
            400,
            f"'max_tokens' is too large: {requested}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len}).",
            param="max_tokens",
            code="context_length_exceeded",
        )


def stopping_params(
    req: SamplingFields,
    *,
    prompt_len: int,
    requested: int | None,
    max_model_len: int,
    vocab_size: int,
    prompt_param: str,
    max_param: str,
) -> StoppingParams:
    """Stopping rules, with ``max_tokens`` checked against the context window like vLLM does."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of '{prompt_param}'.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        max_tokens = room
    elif requested > room:
        raise ApiError(
            400,
            f"'{max_param}' is too large: {requested}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len}).",
            param=max_param,
            code="context_length_exceeded",
        )
    else:
        max_tokens = requested
    if req.min_tokens > max_tokens:
        raise invalid(
            f"'min_tokens' ({req.min_tokens}) must not exceed the token limit ({max_tokens})",
            "min_tokens",
        )
    if req.stop_token_ids:
        check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids", a_set=True)
    return StoppingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop_strings(req),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
    )


_DEFAULT_LIMITS = InputLimits()


def _json_spec(value: str | dict[str, object], param: str, limits: InputLimits) -> str:
    if isinstance(value, str):
        check_json_text(value, param, limits)
        try:
            orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise invalid(f"'{param}' is not valid JSON: {exc}", param) from None
        return value
    return orjson.dumps(value).decode()


# vLLM removed these in favour of ``structured_outputs``; its server now ignores them with a
# warning, leaving output unconstrained. Rankgate still applies the four constraints (a client
# written for an older vLLM keeps its constrained output) and warns the same way.
REMOVED_GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)
_warned_removed: set[str] = set()


def warn_removed_fields(req: SamplingFields) -> None:
    """vLLM's warning for its removed guided-decoding fields, once per field name."""
    used = [
        name
        for name in REMOVED_GUIDED_FIELDS
        if getattr(req, name) is not None and name not in _warned_removed
    ]
    if not used:
        return
    _warned_removed.update(used)
    log.warning(
        "Request contains the guided-decoding field(s) %s, which vLLM has removed (its server "
        "ignores them, leaving output unconstrained). Rankgate still applies guided_json, "
        "guided_regex, guided_choice and guided_grammar, and ignores the backend and "
        "whitespace options. Use `structured_outputs` (or `response_format`) instead.",
        used,
    )


def structured_output(
    req: SamplingFields, limits: InputLimits = _DEFAULT_LIMITS
) -> StructuredOutput | None:
    """The one structured-output constraint the request asks for, from any of its spellings.

    A schema sent as JSON text gets the body's shape limits before the engine parses it."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        found.append(("response_format", StructuredOutput(kind="json_object")))
    elif isinstance(fmt, ResponseFormatJsonSchema):
        schema = fmt.json_schema.schema
        if schema is None:
            raise invalid(
                "'response_format.json_schema.schema' is required for type json_schema",
                "response_format.json_schema.schema",
            )
        found.append(
            ("response_format", StructuredOutput(kind="json", spec=_json_spec(schema, "", limits)))
        )
    if req.guided_json is not None:
        spec = _json_spec(req.guided_json, "guided_json", limits)
        found.append(("guided_json", StructuredOutput(kind="json", spec=spec)))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput(kind="regex", spec=req.guided_regex)))
    if req.guided_choice is not None:
        choices = tuple(req.guided_choice)
        found.append(("guided_choice", StructuredOutput(kind="choice", choices=choices)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutput(kind="grammar", spec=req.guided_grammar)))
    so = req.structured_outputs
    if so is not None:
        inner: list[StructuredOutput] = []
        if so.json is not None:
            inner.append(
                StructuredOutput(
                    kind="json", spec=_json_spec(so.json, "structured_outputs.json", limits)
                )
            )
        if so.regex is not None:
            inner.append(StructuredOutput(kind="regex", spec=so.regex))
        if so.choice is not None:
            inner.append(StructuredOutput(kind="choice", choices=tuple(so.choice)))
        if so.grammar is not None:
            inner.append(StructuredOutput(kind="grammar", spec=so.grammar))
        if so.json_object:
            inner.append(StructuredOutput(kind="json_object"))
        if so.structural_tag is not None:
            inner.append(StructuredOutput(kind="structural_tag", spec=so.structural_tag))
        if len(inner) != 1:
            raise invalid(
                "'structured_outputs' must set exactly one of json, regex, choice, grammar, "
                "json_object, structural_tag",
                "structured_outputs",
            )
        found.append(("structured_outputs", inner[0]))
    if (
        req.guided_decoding_backend is not None
        or req.guided_whitespace_pattern is not None
        or any(name.startswith("guided_") for name, _ in found)
    ):
        warn_removed_fields(req)
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise invalid(
            f"only one structured-output constraint may be given (got {names})", found[1][0]
        )
    return found[0][1] if found else None
