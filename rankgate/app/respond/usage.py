"""Token accounting for ``usage``: the engine's counts, falling back to what the gateway saw."""

from __future__ import annotations

from rankgate.app.respond.context import ResponseContext
from rankgate.app.schemas.responses import Usage
from rankgate.sidecar import Delta


class UsageCounter:
    __slots__ = ("_completion", "_done", "_n", "_prompt", "_streamed")

    def __init__(self, ctx: ResponseContext) -> None:
        self._n = ctx.n
        # Per prompt: the engine's prompt count (includes expanded image tokens) once known.
        self._prompt: list[int] = list(ctx.prompt_lengths)
        self._streamed = [0] * ctx.choices
        self._completion = [0] * ctx.choices
        self._done = [False] * ctx.choices

    def add(self, delta: Delta) -> None:
        i = delta.index
        if delta.prompt_tokens is not None:
            self._prompt[i // self._n] = delta.prompt_tokens
        self._streamed[i] += len(delta.token_ids)
        if delta.finish_reason is not None:
            self._done[i] = True
            self._completion[i] = (
                delta.completion_tokens
                if delta.completion_tokens is not None
                else self._streamed[i]
            )

    def finished(self, index: int) -> bool:
        return self._done[index]

    @property
    def all_finished(self) -> bool:
        return all(self._done)

    def usage(self) -> Usage:
        prompt = sum(self._prompt)
        completion = sum(
            c if done else s
            for c, s, done in zip(self._completion, self._streamed, self._done, strict=True)
        )
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
