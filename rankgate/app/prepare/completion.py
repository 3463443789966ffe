"""OpenAI completions requests → one tokenized :class:`PreparedRequest` per prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from rankgate.app.edge.limits import InputLimits, check_engine_json, check_fanout
from rankgate.app.errors import invalid, unsupported
from rankgate.app.prepare.context import PrepareContext
from rankgate.app.prepare.params import (
    check_token_ids,
    prompt_logprobs_of,
    refuse_unfitting_text,
    refuse_unsupported,
    sampling_params,
    stopping_params,
    structured_output,
)
from rankgate.app.prepare.rank import resolve_rank
from rankgate.app.schemas.requests import CompletionRequest
from rankgate.app.serving.offload import offload
from rankgate.app.tokens.tokenizer import TextTokenizer
from rankgate.sidecar import OutputOptions, PreparedRequest

MAX_PROMPTS = 256
# Requests with bodies larger than this (bytes) are checked and tokenized off the event loop.
OFFLOAD_BYTES = 16_384
DEFAULT_MAX_TOKENS = 16
_COMPLETION_REFUSED = (
    ("suffix", "is not supported (no insertion mode)"),
    ("prompt_embeds", "is not supported"),
)

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    requests: tuple[PreparedRequest, ...]
    prompt_lengths: tuple[int, ...]
    echo: tuple[str, ...] | None
    top_logprobs: int | None
    # Candidates per prompt token, when the prompt's logprobs were asked for (``echo`` with
    # ``logprobs``, or ``prompt_logprobs``).
    prompt_logprobs: int | None = None
    # ``echo`` with ``max_tokens: 0``: the engine generates one token (vLLM reads 0 as its
    # default), and the answer is the prompt alone, as vLLM's server answers it.
    echo_only: bool = False


_JUST_INT = {int}


def split_prompts(value: str | list[object]) -> list[Prompt]:
    """OpenAI's four prompt shapes as a list of text or token prompts, or a 400 naming why."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise invalid("'prompt' must not be an empty list", "prompt")
    first = value[0]
    if isinstance(first, bool) or not isinstance(first, str | int | list):
        raise invalid("'prompt' items must be strings, token ids or token-id lists", "prompt[0]")
    if isinstance(first, int):
        # A flat array of token ids is one prompt, however long.
        return [_token_list(value, "prompt")]
    if len(value) > MAX_PROMPTS:
        raise invalid(f"'prompt' may hold at most {MAX_PROMPTS} prompts", "prompt")
    prompts: list[Prompt] = []
    for i, item in enumerate(value):
        where = f"prompt[{i}]"
        if isinstance(first, str):
            if not isinstance(item, str):
                raise invalid("a batch of prompts must all be strings", where)
            prompts.append(item)
        else:
            if not isinstance(item, list):
                raise invalid("a batch of token prompts must all be token-id lists", where)
            prompts.append(_token_list(item, where))
    return prompts


def _token_list(items: list[object], where: str) -> list[int]:
    if not items:
        raise invalid("a token prompt must not be empty", where)
    # A decoded JSON array of ids is checked in C (``type``, not ``isinstance``: a bool is an
    # int too): a prompt of thousands of ids would otherwise cost a Python loop per id.
    ids = cast("list[int]", items)
    if set(map(type, ids)) == _JUST_INT and min(ids) >= 0:
        return ids
    for j, token in enumerate(items):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise invalid("token ids must be non-negative integers", f"{where}[{j}]")
    return [int(t) for t in items]  # type: ignore[call-overload]


class CompletionPreparer:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        limits: InputLimits | None = None,
    ) -> None:
        self._tok = tokenizer
        self._limits = limits or InputLimits()

    async def prepare(self, req: CompletionRequest, ctx: PrepareContext) -> PreparedCompletion:
        """``ctx.body_size`` (bytes of the request body) decides whether the prompts are
        checked and tokenized off the event loop."""
        refuse_unsupported(req, _COMPLETION_REFUSED)
        rank = resolve_rank(req.data_parallel_rank, ctx.rank)
        if req.best_of is not None and req.best_of != req.n:
            raise unsupported("best_of", "is supported only when equal to n")
        if req.max_tokens == 0 and not req.echo:
            raise invalid("'max_tokens' may be 0 only with 'echo'", "max_tokens")
        if req.kv_transfer_params:
            check_engine_json(req.kv_transfer_params, "kv_transfer_params")
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        if ctx.body_size > OFFLOAD_BYTES:
            return await offload(ctx.body_size, self._build, req, add_special, ctx, rank)
        return self._build(req, add_special, ctx, rank)

    def _build(
        self, req: CompletionRequest, add_special: bool, ctx: PrepareContext, rank: int | None
    ) -> PreparedCompletion:
        prompts, token_prompts = self._tokenize(req, add_special, ctx.max_model_len)
        return self._requests(req, prompts, token_prompts, ctx, rank)

    def _tokenize(
        self, req: CompletionRequest, add_special: bool, max_model_len: int
    ) -> tuple[list[Prompt], list[list[int]]]:
        prompts = split_prompts(req.prompt)
        check_fanout(len(prompts), req.n, self._limits)
        texts = [p for p in prompts if isinstance(p, str)]
        if req.truncate_prompt_tokens is None:
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str) and self._tok.surely_exceeds(prompt, max_model_len):
                    where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                    raise refuse_unfitting_text(len(prompt), max_model_len, where)
        encoded: list[list[int]] = []
        if len(texts) == 1:
            encoded = [self._tok.encode(texts[0], add_special)]
        elif texts:
            encoded = self._tok.encode_batch(texts, add_special)
        next_text = iter(encoded)
        token_prompts: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = next(next_text)
            else:
                check_token_ids(prompt, self._tok.vocab_size, where)
                ids = prompt
            if not ids:
                raise invalid("the prompt is empty after tokenization", where)
            if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
                ids = ids[-req.truncate_prompt_tokens :]
            token_prompts.append(ids)
        return prompts, token_prompts

    def _requests(
        self,
        req: CompletionRequest,
        prompts: list[Prompt],
        token_prompts: list[list[int]],
        ctx: PrepareContext,
        rank: int | None,
    ) -> PreparedCompletion:
        request_id, max_model_len = ctx.request_id, ctx.max_model_len
        sampling = sampling_params(req, self._tok.vocab_size)
        structured = structured_output(req, self._limits)
        prompt_logprobs = prompt_logprobs_of(req, default=req.logprobs if req.echo else None)
        output = OutputOptions(
            logprobs=req.logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
        echo_only = req.max_tokens == 0
        requested = DEFAULT_MAX_TOKENS if req.max_tokens is None else max(req.max_tokens, 1)
        requests: list[PreparedRequest] = []
        for i, ids in enumerate(token_prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            stopping = stopping_params(
                req,
                prompt_len=len(ids),
                requested=min(requested, max_model_len - len(ids))
                if req.max_tokens is None
                else requested,
                max_model_len=max_model_len,
                vocab_size=self._tok.vocab_size,
                prompt_param=where,
                max_param="max_tokens",
            )
            requests.append(
                PreparedRequest(
                    request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
                    prompt_token_ids=tuple(ids),
                    sampling=sampling,
                    stopping=stopping,
                    output=output,
                    structured=structured,
                    n=req.n,
                    cache_salt=req.cache_salt,
                    priority=req.priority,
                    lora_name=ctx.lora_name,
                    kv_transfer_params=req.kv_transfer_params,
                    rank=rank,
                    affinity=ctx.affinity,
                    stream=req.stream,
                    trace=ctx.trace,
                )
            )
        echo: tuple[str, ...] | None = None
        if req.echo:
            echo = tuple(
                p if isinstance(p, str) else self._tok.decode(p, skip_special_tokens=False)
                for p in prompts
            )
        return PreparedCompletion(
            requests=tuple(requests),
            prompt_lengths=tuple(len(ids) for ids in token_prompts),
            echo=echo,
            top_logprobs=req.logprobs,
            prompt_logprobs=prompt_logprobs,
            echo_only=echo_only,
        )
