"""Server-sent events for streamed chat and text completions.

This is the per-token hot path. Each request pre-encodes the constant head and tail of its
chunks once (id, object, created, model), so a token costs one ``orjson.dumps`` of its text and
a few byte concatenations; only requests with reasoning/tool parsing or logprobs build Structs.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable

import msgspec
import orjson

from rankgate.app.parsers import ChoiceParser, Parsed
from rankgate.app.respond.context import ResponseContext
from rankgate.app.respond.sse import DONE, DeltaEvents, Guarded
from rankgate.app.respond.usage import UsageCounter
from rankgate.app.schemas.responses import (
    ChatDelta,
    CompletionLogprobs,
    ToolCallDelta,
    ToolCallDeltaFunction,
    Usage,
)
from rankgate.sidecar import Delta

_ENCODER = msgspec.json.Encoder()
_FINISH = {None: b"null", "stop": b'"stop"', "length": b'"length"', "abort": b'"abort"'}
_INDEX = [str(i).encode() for i in range(1024)]


def _index(i: int) -> bytes:
    return _INDEX[i] if i < 1024 else str(i).encode()


def _finish(reason: str | None) -> bytes:
    encoded = _FINISH.get(reason)
    return encoded if encoded is not None else orjson.dumps(reason)


def _head(ctx: ResponseContext, obj: bytes) -> bytes:
    return (
        b'data: {"id":"'
        + ctx.response_id.encode()
        + b'","object":"'
        + obj
        + b'","created":'
        + str(ctx.created).encode()
        + b',"model":'
        + orjson.dumps(ctx.model)
        + b',"choices":['
    )


class _Frame:
    """The constant parts of one request's chunks."""

    __slots__ = ("choice", "close", "continuous", "head", "text_close")

    def __init__(self, ctx: ResponseContext, obj: bytes) -> None:
        self.head = _head(ctx, obj)
        self.choice = self.head + b'{"index":'
        self.continuous = ctx.continuous_usage
        usage = b',"usage":null' if ctx.include_usage and not ctx.continuous_usage else b""
        self.close = b"]" + usage + b"}\n\n"
        # The end of a chat delta that carries text only, finish and logprobs null.
        self.text_close = b'},"logprobs":null,"finish_reason":null}' + self.close

    def end(self, usage: UsageCounter) -> bytes:
        if not self.continuous:
            return self.close
        return b'],"usage":' + _ENCODER.encode(usage.usage()) + b"}\n\n"

    def usage_chunk(self, usage: Usage) -> bytes:
        return self.head + b'],"usage":' + _ENCODER.encode(usage) + b"}\n\n"


class _ChatChunks:
    """One chat stream's chunk encoder: the bytes each delta adds to the stream."""

    __slots__ = (
        "choice",
        "fast",
        "fmt",
        "frame",
        "include_usage",
        "parsers",
        "prefixes",
        "started",
        "usage",
    )

    def __init__(self, ctx: ResponseContext) -> None:
        self.include_usage = ctx.include_usage
        self.frame = frame = _Frame(ctx, b"chat.completion.chunk")
        self.usage = UsageCounter(ctx)
        self.started = [False] * ctx.choices
        self.parsers = (
            [ChoiceParser(ctx.plan) for _ in range(ctx.choices)] if ctx.plan.active else None
        )
        self.fmt = ctx.logprobs
        self.choice = frame.choice
        # The common delta (text only, no parsing, logprobs or running usage) is its choice's
        # prefix, the text as JSON and one constant suffix.
        self.fast = self.parsers is None and self.fmt is None and not frame.continuous
        self.prefixes: dict[int, bytes] = {}

    def chunk(self, delta: Delta) -> bytes:
        usage = self.usage
        frame = self.frame
        usage.add(delta)
        i = delta.index
        out = b""
        if not self.started[i]:
            self.started[i] = True
            out = (
                self.choice
                + _index(i)
                + b',"delta":{"role":"assistant","content":""},"logprobs":null,'
                + b'"finish_reason":null}'
                + frame.end(usage)
            )
        finish: str | None = delta.finish_reason
        if self.fast and finish is None and delta.text:
            prefix = self.prefixes.get(i)
            if prefix is None:
                prefix = self.prefixes[i] = self.choice + _index(i) + b',"delta":{"content":'
            return out + prefix + orjson.dumps(delta.text) + frame.text_close
        logprobs = b"null"
        fmt = self.fmt
        if fmt is not None and delta.logprobs:
            logprobs = b'{"content":' + _ENCODER.encode(fmt.chat(delta.logprobs)) + b"}"
        parsers = self.parsers
        if parsers is not None:
            parser = parsers[i]
            parsed = parser.feed(delta.text)
            if finish is not None:
                _merge(parsed, parser.finish())
                finish = parser.finish_reason(finish)
            bodies = _parsed_deltas(parsed)
            if not bodies:
                if finish is None and logprobs == b"null":
                    return out
                bodies = [b"{}"]
            # A call's name and its arguments go out as successive chunks, as OpenAI streams.
            for body in bodies[:-1]:
                out += (
                    self.choice
                    + _index(i)
                    + b',"delta":'
                    + body
                    + b',"logprobs":null,"finish_reason":null}'
                    + frame.end(usage)
                )
            delta_json = bodies[-1]
        elif delta.text:
            delta_json = b'{"content":' + orjson.dumps(delta.text) + b"}"
        elif finish is not None or logprobs != b"null":
            delta_json = b"{}"
        else:
            return out
        return (
            out
            + self.choice
            + _index(i)
            + b',"delta":'
            + delta_json
            + b',"logprobs":'
            + logprobs
            + b',"finish_reason":'
            + _finish(finish)
            + b"}"
            + frame.end(usage)
        )

    def tail(self) -> bytes:
        head = self.frame.usage_chunk(self.usage.usage()) if self.include_usage else b""
        return head + DONE


def chat_events(ctx: ResponseContext, deltas: AsyncIterator[Delta]) -> DeltaEvents:
    """The chat completion chunks of ``deltas``, ``[DONE]`` last."""
    return DeltaEvents(_ChatChunks(ctx), deltas)


def _merge(into: Parsed, more: Parsed) -> None:
    into.reasoning += more.reasoning
    into.content += more.content
    into.calls.extend(more.calls)


def _parsed_deltas(parsed: Parsed) -> list[bytes]:
    """The chat deltas of one parsed step: text and reasoning with the first call entry, then
    one call entry per delta (a call's id and name, then its arguments)."""
    deltas: list[ChatDelta] = []
    if parsed.reasoning or parsed.content:
        first = ChatDelta()
        if parsed.reasoning:
            first.reasoning_content = parsed.reasoning
        if parsed.content:
            first.content = parsed.content
        deltas.append(first)
    for n, call in enumerate(parsed.calls):
        item = ToolCallDelta(
            index=call.index, function=ToolCallDeltaFunction(arguments=call.arguments)
        )
        if call.id is not None:
            item.id = call.id
            item.type = "function"
        if call.name is not None:
            item.function.name = call.name
        if n == 0 and deltas:
            deltas[0].tool_calls = [item]
        else:
            deltas.append(ChatDelta(tool_calls=[item]))
    return [_ENCODER.encode(d) for d in deltas]


class _CompletionChunks:
    """One text-completion stream's chunk encoder."""

    __slots__ = ("choice", "ctx", "fmt", "frame", "include_usage", "offsets", "started", "usage")

    def __init__(self, ctx: ResponseContext) -> None:
        self.include_usage = ctx.include_usage
        self.ctx = ctx
        self.frame = _Frame(ctx, b"text_completion")
        self.usage = UsageCounter(ctx)
        self.started = [False] * ctx.choices
        self.offsets = [0] * ctx.choices
        self.fmt = ctx.logprobs
        self.choice = self.frame.choice

    def chunk(self, delta: Delta) -> bytes:
        usage = self.usage
        usage.add(delta)
        i = delta.index
        text = delta.text
        entries = delta.logprobs
        if self.ctx.echo_only:
            text, entries = "", None
        offsets = self.offsets
        fmt = self.fmt
        lp: CompletionLogprobs | None = None
        if not self.started[i]:
            self.started[i] = True
            echo = self.ctx.echo
            if echo is not None:
                prefix = echo[i // self.ctx.n]
                offsets[i] = len(prefix)
                text = prefix + text
                if fmt is not None and delta.prompt_logprobs is not None:
                    # As vLLM streams it: the echoed prompt's logprobs lead the first chunk.
                    lp = _no_logprobs()
                    offsets[i] = fmt.completion_prompt(
                        delta.prompt_token_ids or (),
                        delta.prompt_logprobs,
                        lp.tokens,
                        lp.token_logprobs,
                        lp.top_logprobs,
                        lp.text_offset,
                    )
        if fmt is not None and entries:
            if lp is None:
                lp = _no_logprobs()
            offsets[i] = fmt.completion(
                entries,
                offsets[i],
                lp.tokens,
                lp.token_logprobs,
                lp.top_logprobs,
                lp.text_offset,
            )
        logprobs = b"null" if lp is None else _ENCODER.encode(lp)
        finish = delta.finish_reason
        if not text and finish is None and logprobs == b"null":
            return b""
        stop = b"null" if delta.stop_reason is None else orjson.dumps(delta.stop_reason)
        return (
            self.choice
            + _index(i)
            + b',"text":'
            + orjson.dumps(text)
            + b',"logprobs":'
            + logprobs
            + b',"finish_reason":'
            + _finish(finish)
            + b',"stop_reason":'
            + stop
            + b"}"
            + self.frame.end(usage)
        )

    def tail(self) -> bytes:
        head = self.frame.usage_chunk(self.usage.usage()) if self.include_usage else b""
        return head + DONE


def _no_logprobs() -> CompletionLogprobs:
    return CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])


def completion_events(ctx: ResponseContext, deltas: AsyncIterator[Delta]) -> DeltaEvents:
    """The text completion chunks of ``deltas``, ``[DONE]`` last."""
    return DeltaEvents(_CompletionChunks(ctx), deltas)


def guarded(
    events: AsyncIterable[bytes],
    source: AsyncIterator[Delta],
    on_done: Callable[[int], None] | None = None,
) -> Guarded:
    """Send a failure as an SSE error event; always drop the engine streams when done.

    ``on_done`` gets the status the stream ended with (200, or the error's status).
    :class:`~rankgate.app.respond.sse.EventStreamResponse` runs the result without a generator
    layer.
    """
    return Guarded(events, source, on_done)
