"""Reasoning and tool-call parsing of model output, under vLLM's parser names.

The entry points other modules use:

- :func:`plan_for` turns the configured parser names, the tokenizer's :class:`Vocabulary` and a
  request's tools and ``tool_choice`` into an :class:`OutputPlan` (plus the JSON schema the
  engine must follow, if any);
- :class:`ChoiceParser` runs a plan over one choice's text: ``feed`` each delta, then
  ``finish``; each returns a :class:`Parsed` of reasoning, content and :class:`CallDelta`\\ s
  (a call's id and name first, then its arguments, each call with its own index).
"""

from __future__ import annotations

from rankgate.app.parsers.choice import CallDelta, ChoiceParser, OutputPlan, Parsed
from rankgate.app.parsers.registry import (
    REASONING_ALIASES,
    REASONING_PARSERS,
    TOOL_ALIASES,
    TOOL_PARSERS,
    PlanResult,
    Tool,
    canonical_reasoning_parser,
    canonical_tool_parser,
    plan_for,
    required_schema,
    vocabulary,
)
from rankgate.app.parsers.types import Vocabulary

TOOL_CALL_PARSERS = tuple(sorted((*TOOL_PARSERS, *TOOL_ALIASES)))
REASONING_PARSER_NAMES = tuple(sorted((*REASONING_PARSERS, *REASONING_ALIASES)))

__all__ = [
    "REASONING_PARSERS",
    "REASONING_PARSER_NAMES",
    "TOOL_CALL_PARSERS",
    "CallDelta",
    "ChoiceParser",
    "OutputPlan",
    "Parsed",
    "PlanResult",
    "Tool",
    "Vocabulary",
    "canonical_reasoning_parser",
    "canonical_tool_parser",
    "plan_for",
    "required_schema",
    "vocabulary",
]
