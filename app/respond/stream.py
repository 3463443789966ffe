"""Server-sent events for streamed chat and text completions.

This is the per-token hot path. Each request pre-encodes the constant head and tail of its
chunks once (id, object, created, model), so a token costs one ``orjson.dumps`` of its text and
a few byte concatenations; only requests with reasoning/tool parsing or logprobs build Structs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import msgspec
import orjson

from app.errors import as_api_error
from app.respond.context import ResponseContext
from app.respond.merge import close_stream
from app.respond.parsers import ChoiceParser, Parsed
from app.respond.usage import UsageCounter
from app.schemas.responses import (
    ChatDelta,
    CompletionLogprobs,
    ToolCallDelta,
    ToolCallDeltaFunction,
    Usage,
)
from sidecar.types import Delta

DONE = b"data: [DONE]\n\n"
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

    __slots__ = ("choice", "close", "continuous", "head", "usage_close")

    def __init__(self, ctx: ResponseContext, obj: bytes) -> None:
        self.head = _head(ctx, obj)
        self.choice = self.head + b'{"index":'
        self.continuous = ctx.continuous_usage
        usage = b',"usage":null' if ctx.include_usage and not ctx.continuous_usage else b""
        self.close = b"]" + usage + b"}\n\n"

    def end(self, usage: UsageCounter) -> bytes:
        if not self.continuous:
            return self.close
        return b'],"usage":' + _ENCODER.encode(usage.usage()) + b"}\n\n"

    def usage_chunk(self, usage: Usage) -> bytes:
        return self.head + b'],"usage":' + _ENCODER.encode(usage) + b"}\n\n"


async def chat_events(ctx: ResponseContext, deltas: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
    frame = _Frame(ctx, b"chat.completion.chunk")
    usage = UsageCounter(ctx)
    started = [False] * ctx.choices
    parsers = [ChoiceParser(ctx.plan) for _ in range(ctx.choices)] if ctx.plan.active else None
    fmt = ctx.logprobs
    choice = frame.choice
    async for delta in deltas:
        usage.add(delta)
        i = delta.index
        idx = _index(i)
        out = b""
        if not started[i]:
            started[i] = True
            out = (
                choice
                + idx
                + b',"delta":{"role":"assistant","content":""},"logprobs":null,'
                + b'"finish_reason":null}'
                + frame.end(usage)
            )
        logprobs = b"null"
        if fmt is not None and delta.logprobs:
            logprobs = b'{"content":' + _ENCODER.encode(fmt.chat(delta.logprobs)) + b"}"
        finish: str | None = delta.finish_reason
        if parsers is not None:
            parser = parsers[i]
            parsed = parser.feed(delta.text)
            if finish is not None:
                _merge(parsed, parser.finish())
                finish = parser.finish_reason(finish)
            body = _parsed_delta(parsed)
            if body is None and finish is None and logprobs == b"null":
                if out:
                    yield out
                continue
            delta_json = body if body is not None else b"{}"
        elif delta.text:
            delta_json = b'{"content":' + orjson.dumps(delta.text) + b"}"
        elif finish is not None or logprobs != b"null":
            delta_json = b"{}"
        else:
            if out:
                yield out
            continue
        yield (
            out
            + choice
            + idx
            + b',"delta":'
            + delta_json
            + b',"logprobs":'
            + logprobs
            + b',"finish_reason":'
            + _finish(finish)
            + b"}"
            + frame.end(usage)
        )
    tail = frame.usage_chunk(usage.usage()) if ctx.include_usage else b""
    yield tail + DONE


def _merge(into: Parsed, more: Parsed) -> None:
    into.reasoning += more.reasoning
    into.content += more.content
    into.calls.extend(more.calls)


def _parsed_delta(parsed: Parsed) -> bytes | None:
    if not (parsed.reasoning or parsed.content or parsed.calls):
        return None
    delta = ChatDelta()
    if parsed.reasoning:
        delta.reasoning_content = parsed.reasoning
    if parsed.content:
        delta.content = parsed.content
    if parsed.calls:
        calls: list[ToolCallDelta] = []
        for call in parsed.calls:
            item = ToolCallDelta(
                index=call.index, function=ToolCallDeltaFunction(arguments=call.arguments)
            )
            if call.id is not None:
                item.id = call.id
                item.type = "function"
            if call.name is not None:
                item.function.name = call.name
            calls.append(item)
        delta.tool_calls = calls
    return _ENCODER.encode(delta)


async def completion_events(
    ctx: ResponseContext, deltas: AsyncIterator[Delta]
) -> AsyncIterator[bytes]:
    frame = _Frame(ctx, b"text_completion")
    usage = UsageCounter(ctx)
    started = [False] * ctx.choices
    offsets = [0] * ctx.choices
    fmt = ctx.logprobs
    echo = ctx.echo
    choice = frame.choice
    async for delta in deltas:
        usage.add(delta)
        i = delta.index
        text = delta.text
        if not started[i]:
            started[i] = True
            if echo is not None:
                text = echo[i // ctx.n] + text
                offsets[i] = len(text) - len(delta.text)
        logprobs = b"null"
        if fmt is not None and delta.logprobs:
            lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
            offsets[i] = fmt.completion(
                delta.logprobs,
                offsets[i],
                lp.tokens,
                lp.token_logprobs,
                lp.top_logprobs,
                lp.text_offset,
            )
            logprobs = _ENCODER.encode(lp)
        finish = delta.finish_reason
        if not text and finish is None and logprobs == b"null":
            continue
        stop = b"null" if delta.stop_reason is None else orjson.dumps(delta.stop_reason)
        yield (
            choice
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
            + frame.end(usage)
        )
    tail = frame.usage_chunk(usage.usage()) if ctx.include_usage else b""
    yield tail + DONE


async def guarded(
    events: AsyncIterator[bytes],
    source: AsyncIterator[Delta],
    on_done: Callable[[int], None] | None = None,
) -> AsyncIterator[bytes]:
    """Send a failure as an SSE error event; always drop the engine streams when done.

    ``on_done`` gets the status the stream ended with (200, or the error's status).
    """
    status = 200
    try:
        async for chunk in events:
            yield chunk
    except Exception as exc:
        error = as_api_error(exc)
        status = error.status
        yield b"data: " + error.body() + b"\n\n" + DONE
    finally:
        await close_stream(source)
        if on_done is not None:
            on_done(status)
