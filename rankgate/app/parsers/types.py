"""The small typed surface every output format implements.

A format is described twice over the same facts: ``extract`` gives the exact result of a whole
output (what vLLM's server returns without streaming), and a few streaming hints say how much
of a growing output is already settled. Streaming releases only settled text and finishes with
``extract`` itself, so a streamed answer always adds up to the non-streamed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

# How a format's content is reported once calls were found:
#   "keep":  as written (None when blank);
#   "strip": stripped of surrounding whitespace;
#   "none":  no content at all beside calls.
ContentRule = Literal["keep", "strip", "none"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    # The model's own call id, for formats that carry one (Kimi K2); else the gateway's.
    id: str | None = None


@dataclass(slots=True)
class Extracted:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    # Whether the format counts the output as calling tools, even with no call read (vLLM's
    # DeepSeek parsers do once the calls section opens); None: whether there are calls.
    called: bool | None = None

    @property
    def tools_called(self) -> bool:
        return bool(self.calls) if self.called is None else self.called


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What a parser may need to know about the model's tokenizer."""

    tokens: frozenset[str] = frozenset()
    special: frozenset[str] = frozenset()

    def has(self, token: str) -> bool:
        return token in self.tokens


@dataclass(frozen=True, slots=True)
class ToolContext:
    """Per-request facts a tool format reads: the request's tool schemas."""

    # Tool name -> its ``parameters`` JSON schema (None when the tool has none).
    schemas: dict[str, dict[str, object] | None] = field(default_factory=dict)
    # tool_choice "none" with tools: the format's calls are neither parsed nor reported.
    suppress: bool = False
    # An output without calls keeps the format's own content (vLLM does so when both its
    # parsers are engine-based); otherwise it is the text as it came.
    engine_content: bool = False


class ToolSyntax(Protocol):
    """One model family's tool-call syntax."""

    # The tool region starts at the first of these; text before it can stream as content.
    @property
    def markers(self) -> tuple[str, ...]: ...

    # Strings ``clean`` removes or rewrites (held while partial, like markers).
    @property
    def rewrites(self) -> tuple[str, ...]: ...

    @property
    def content_rule(self) -> ContentRule: ...

    # JSON-schema enforcement of tool_choice required/named applies (vLLM's generic path);
    # False: those choices are parsed like "auto" from the format itself.
    @property
    def json_forcing(self) -> bool: ...

    # vLLM parses this family with its parser engine (which also shapes the content of
    # outputs without calls, and of tool_choice "none").
    @property
    def engine(self) -> bool: ...

    def holds_all(self, text: str) -> bool | None:
        """Whether nothing may stream for an output starting with ``text``; None: unknown yet."""
        ...

    def clean(self, text: str) -> str:
        """The content a marker-free stretch of output contributes (local transformation)."""
        ...

    def extract(self, text: str, ctx: ToolContext) -> Extracted: ...


class ReasoningSplitter(Protocol):
    """Splits reasoning from the answer incrementally; ``finish`` settles what is held.

    Each call returns ``(reasoning, content)`` text that is final: the pieces of a stream add
    up to the whole output's split (empty text meaning none).
    """

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...
