"""Everything the response side needs to know about a prepared request, fixed before it runs."""

from __future__ import annotations

from typing import Literal

import msgspec

from rankgate.app.parsers import OutputPlan
from rankgate.app.respond.logprobs import LogprobFormatter

NO_PARSING = OutputPlan()


class ResponseContext(msgspec.Struct, frozen=True, kw_only=True):
    """A Struct, not a frozen dataclass: one is made per request, and a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``."""

    kind: Literal["chat", "completion"]
    response_id: str
    created: int
    model: str
    # Choices per prompt; a completions batch has ``len(prompt_lengths)`` prompts.
    n: int
    prompt_lengths: tuple[int, ...]
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: LogprobFormatter | None = None
    plan: OutputPlan = NO_PARSING
    # The prompt's logprobs, when asked for, with this many candidates per token: vLLM's
    # ``prompt_logprobs`` list, and with ``echo`` and ``logprobs`` the start of ``logprobs``.
    prompt_logprobs: LogprobFormatter | None = None
    # Completions ``echo``: the prompt text to put before each choice's output, per prompt.
    echo: tuple[str, ...] | None = None
    # ``echo`` with ``max_tokens: 0``: the prompt alone; the engine's one token is dropped.
    echo_only: bool = False

    @property
    def choices(self) -> int:
        return self.n * len(self.prompt_lengths)
