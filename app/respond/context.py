"""Everything the response side needs to know about a prepared request, fixed before it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.respond.logprobs import LogprobFormatter
from app.respond.parsers import OutputPlan

NO_PARSING = OutputPlan()


@dataclass(frozen=True, slots=True)
class ResponseContext:
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
    # Completions ``echo``: the prompt text to put before each choice's output, per prompt.
    echo: tuple[str, ...] | None = None

    @property
    def choices(self) -> int:
        return self.n * len(self.prompt_lengths)
