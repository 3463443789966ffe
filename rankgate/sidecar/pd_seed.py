"""First-token seeding: the client's first token comes from the prefill, not the decode.

A remote prefill computes the whole prompt and samples one token anyway. Sampled with the
client's own parameters (seed, temperature, logit bias, structured output, logprobs, stop
rules), it is the token the aggregated path would have sent first: the same model, the same
prompt and the same first draw of the same seeded generator. The client gets it as soon as the
prefill returns, instead of after the transfer and the decode's first step.

The decode is sent exactly as without seeding (vLLM 0.32's NIXL connector loads the prompt's
KV and recomputes the last prompt position, so it samples that first token again, from the
same KV, with the same generator) and its first token is taken out of its stream: the rest
follows from the KV it read, draw for draw, as the aggregated path's would. A decode whose
first token differs from the seeded one (logits that differ in their last bits between a
batched prefill and a one-token step, at a near tie) is counted; its stream goes on. Unseeded
random sampling is not seeded (the two engines would draw independently). A first
token that ends inside a UTF-8 character is not seeded: alone it reads as U+FFFD, while the
stream shows the character once the next token completes it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

import msgspec

from rankgate.sidecar.types import Delta, PreparedRequest, StoppingParams


def reproducible(request: PreparedRequest) -> bool:
    """Whether the decode samples the prefill's token again: greedy, or seeded. An unseeded
    random sample on each engine is two independent draws, and the client would get one
    token and the continuation of another."""
    return request.sampling.temperature == 0.0 or request.sampling.seed is not None


def prefill_stopping(request: PreparedRequest) -> StoppingParams:
    """The client's stop rules for a one-token prefill: a first token that is EOS, a stop
    token or completes a stop string ends the answer there, as it would aggregated."""
    stopping = request.stopping
    return msgspec.structs.replace(stopping, max_tokens=1, min_tokens=min(stopping.min_tokens, 1))


def ends_answer(first: Delta, request: PreparedRequest) -> bool:
    """Whether the prefill's token is the whole answer (a stop, or ``max_tokens`` 1)."""
    return first.finish_reason == "stop" or request.stopping.max_tokens <= 1


def held_back(prefilled: Delta) -> bool:
    """Whether the token's text is not final on its own: it ends inside a character (the
    engine writes U+FFFD for the bytes so far), and the stream would show that character only
    with the next token. Such a token is not seeded; the decode's stream goes out whole."""
    return prefilled.text.endswith("\ufffd")


def opening(prefilled: Delta) -> Delta:
    """The prefill's last delta as the client's first: its token, without the prefill's
    finish or transfer params."""
    return msgspec.structs.replace(
        prefilled,
        finish_reason=None,
        stop_reason=None,
        completion_tokens=None,
        kv_transfer_params=None,
    )


def answer(prefilled: Delta) -> Delta:
    """The prefill's last delta as the client's whole answer (its token ended it)."""
    return msgspec.structs.replace(prefilled, kv_transfer_params=None)


async def after_seed(
    stream: AsyncGenerator[Delta, None], seeded: Delta, mismatch: Callable[[int, int], None]
) -> AsyncGenerator[Delta, None]:
    """``stream`` (a decode of the same prompt) without its first token, which the client
    has from ``seeded`` already; ``mismatch(seeded, decoded)`` is told when the two differ."""
    pending = True
    try:
        async for delta in stream:
            if pending:
                if not delta.token_ids:
                    if delta.finish_reason is None:
                        continue
                    pending = False
                    yield _later(delta)
                    continue
                pending = False
                trimmed = _without_first(delta, seeded, mismatch)
                if trimmed is None:
                    continue
                delta = trimmed
            yield delta
    finally:
        await stream.aclose()


def _later(delta: Delta) -> Delta:
    """``delta`` without what only a choice's first delta carries (the client had it)."""
    return msgspec.structs.replace(
        delta,
        prompt_tokens=None,
        prompt_token_ids=None,
        prompt_logprobs=None,
        rank=None,
        cached_tokens=None,
        route=None,
    )


def _without_first(
    delta: Delta, seeded: Delta, mismatch: Callable[[int, int], None]
) -> Delta | None:
    token = delta.token_ids[0]
    expected = seeded.token_ids[0] if seeded.token_ids else token
    if token != expected:
        mismatch(expected, token)
    text = delta.text
    if seeded.text and text.startswith(seeded.text):
        text = text[len(seeded.text) :]
    logprobs = delta.logprobs[1:] if delta.logprobs else delta.logprobs
    rest = msgspec.structs.replace(
        _later(delta), text=text, token_ids=delta.token_ids[1:], logprobs=logprobs
    )
    if not rest.token_ids and not rest.text and rest.finish_reason is None:
        return None
    return rest
