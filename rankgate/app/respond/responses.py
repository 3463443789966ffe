"""Responses API output: the model's parsed output as output items, and the stream of
semantic events that tells a client how they grow.

One builder serves both shapes. Fed the parser's pieces (reasoning, content, tool-call
deltas) it opens an item when the kind of output changes and closes the previous one; a
streamed response turns each step into its events (``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``), a whole
response only keeps the items. A text delta costs one ``orjson.dumps`` of its text between
the pre-encoded head of its item and the sequence number.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from rankgate.app.errors import as_api_error
from rankgate.app.parsers import CallDelta, ChoiceParser, OutputPlan, Parsed
from rankgate.app.schemas.requests import AssistantMessage, FunctionCall, Message, ToolCall
from rankgate.app.schemas.responses_api import (
    FunctionCallOut,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    MessageOut,
    OutputItem,
    OutputTextOut,
    OutputTokensDetails,
    ReasoningOptions,
    ReasoningOut,
    ReasoningTextOut,
    ResponseErrorOut,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from rankgate.sidecar import Delta

_ENCODER = msgspec.json.Encoder()
_SEQ = b',"sequence_number":'
_END = b"}\n\n"

# Called with the finished response and its encoded body (to store it).
OnDone = Callable[[ResponseObject, bytes], None]


def new_item_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


@dataclass(frozen=True, slots=True)
class ResponsesContext:
    """What the response side knows before the engine answers."""

    # The response as announced: id, created_at, model and the request's echoed options.
    base: ResponseObject
    plan: OutputPlan
    prompt_len: int
    # Tokens of a text, for ``output_tokens_details.reasoning_tokens``.
    count_tokens: Callable[[str], int]
    on_done: OnDone | None = None


class _Events:
    """The SSE bytes of events, numbered in the order they are written."""

    __slots__ = ("out", "sequence")

    def __init__(self) -> None:
        self.sequence = 0
        self.out: list[bytes] = []

    def emit(self, kind: str, fields: dict[str, Any]) -> None:
        body = _ENCODER.encode({"type": kind, **fields, "sequence_number": self.sequence})
        self.sequence += 1
        self.out.append(b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n")

    def delta(self, head: bytes, text: str) -> None:
        self.out.append(head + orjson.dumps(text) + _SEQ + str(self.sequence).encode() + _END)
        self.sequence += 1

    def take(self) -> bytes:
        out, self.out = self.out, []
        return b"".join(out)


def _delta_head(kind: str, item_id: str, index: int, content: bool, logprobs: bool) -> bytes:
    fields = b'"item_id":"' + item_id.encode() + b'","output_index":' + str(index).encode()
    if content:
        fields += b',"content_index":0'
    if logprobs:
        fields += b',"logprobs":[]'
    name = kind.encode()
    return b"event: " + name + b'\ndata: {"type":"' + name + b'",' + fields + b',"delta":'


class OutputBuilder:
    """Output items from parsed pieces, with their events when ``events`` is given."""

    __slots__ = (
        "_call",
        "_events",
        "_head",
        "_item_id",
        "_open",
        "_parts",
        "items",
        "reasoning",
    )

    def __init__(self, events: _Events | None) -> None:
        self._events = events
        self.items: list[OutputItem] = []
        self.reasoning: list[str] = []
        self._open: str | None = None
        self._item_id = ""
        self._parts: list[str] = []
        self._head = b""
        # The open function call: (call_id, name).
        self._call: tuple[str, str] = ("", "")

    def feed(self, parsed: Parsed) -> None:
        if parsed.reasoning:
            self.text("reasoning", parsed.reasoning)
        if parsed.content:
            self.text("message", parsed.content)
        for call in parsed.calls:
            self.call(call)

    def text(self, kind: str, text: str) -> None:
        if self._open != kind:
            self.close("completed")
            self._start(kind)
        self._parts.append(text)
        if kind == "reasoning":
            self.reasoning.append(text)
        events = self._events
        if events is not None:
            events.delta(self._head, text)

    def call(self, call: CallDelta) -> None:
        if call.id is not None or self._open != "call":
            self.close("completed")
            self._start("call", call.id or new_item_id("call_"), call.name or "")
        if call.arguments:
            self._parts.append(call.arguments)
            events = self._events
            if events is not None:
                events.delta(self._head, call.arguments)

    def _start(self, kind: str, call_id: str = "", name: str = "") -> None:
        prefix = {"message": "msg_", "reasoning": "rs_", "call": "fc_"}[kind]
        self._open = kind
        self._item_id = item_id = new_item_id(prefix)
        self._parts = []
        self._call = (call_id, name)
        events = self._events
        if events is None:
            return
        index = len(self.items)
        if kind == "call":
            item: OutputItem = FunctionCallOut(
                id=item_id, call_id=call_id, name=name, arguments="", status="in_progress"
            )
            events.emit("response.output_item.added", {"output_index": index, "item": item})
            self._head = _delta_head(
                "response.function_call_arguments.delta", item_id, index, False, False
            )
            return
        part: Any
        if kind == "message":
            item = MessageOut(id=item_id, status="in_progress", content=[])
            part = OutputTextOut(text="")
            self._head = _delta_head("response.output_text.delta", item_id, index, True, True)
        else:
            item = ReasoningOut(id=item_id, content=[], status="in_progress")
            part = ReasoningTextOut(text="")
            self._head = _delta_head("response.reasoning_text.delta", item_id, index, True, False)
        events.emit("response.output_item.added", {"output_index": index, "item": item})
        events.emit(
            "response.content_part.added",
            {"item_id": item_id, "output_index": index, "content_index": 0, "part": part},
        )

    def close(self, status: ItemStatus) -> None:
        """End the open item (if any) with ``status``."""
        kind = self._open
        if kind is None:
            return
        self._open = None
        item_id = self._item_id
        text = "".join(self._parts)
        index = len(self.items)
        events = self._events
        item: OutputItem
        if kind == "call":
            call_id, name = self._call
            item = FunctionCallOut(
                id=item_id, call_id=call_id, name=name, arguments=text, status=status
            )
            if events is not None:
                events.emit(
                    "response.function_call_arguments.done",
                    {"item_id": item_id, "output_index": index, "name": name, "arguments": text},
                )
        else:
            part: Any
            if kind == "message":
                part = OutputTextOut(text=text)
                item = MessageOut(id=item_id, status=status, content=[part])
                done = "response.output_text.done"
                extra: dict[str, Any] = {"text": text, "logprobs": []}
            else:
                part = ReasoningTextOut(text=text)
                item = ReasoningOut(id=item_id, content=[part], status=status)
                done = "response.reasoning_text.done"
                extra = {"text": text}
            if events is not None:
                where = {"item_id": item_id, "output_index": index, "content_index": 0}
                events.emit(done, {**where, **extra})
                events.emit("response.content_part.done", {**where, "part": part})
        self.items.append(item)
        if events is not None:
            events.emit("response.output_item.done", {"output_index": index, "item": item})


class _Tally:
    """Prompt and output token counts: the engine's, else what the stream showed."""

    __slots__ = ("completion", "finish", "prompt", "streamed")

    def __init__(self, prompt_len: int) -> None:
        self.prompt = prompt_len
        self.streamed = 0
        self.completion: int | None = None
        self.finish: str | None = None

    def add(self, delta: Delta) -> None:
        if delta.prompt_tokens is not None:
            self.prompt = delta.prompt_tokens
        self.streamed += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason
            self.completion = delta.completion_tokens

    @property
    def output(self) -> int:
        return self.streamed if self.completion is None else self.completion


def _finished(
    ctx: ResponsesContext, builder: OutputBuilder, tally: _Tally, finish: str | None
) -> ResponseObject:
    status: Any = "completed"
    incomplete = None
    error = None
    item_status: ItemStatus = "completed"
    if finish == "length":
        status = item_status = "incomplete"
        incomplete = IncompleteDetails(reason="max_output_tokens")
    elif finish == "abort":
        status, item_status = "failed", "incomplete"
        error = ResponseErrorOut(code="server_error", message="the engine aborted the request")
    builder.close(item_status)
    reasoning = "".join(builder.reasoning)
    output = tally.output
    usage = ResponseUsage(
        input_tokens=tally.prompt,
        output_tokens=output,
        total_tokens=tally.prompt + output,
        input_tokens_details=InputTokensDetails(),
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=min(output, ctx.count_tokens(reasoning)) if reasoning else 0
        ),
    )
    return msgspec.structs.replace(
        ctx.base,
        status=status,
        output=builder.items,
        usage=usage,
        incomplete_details=incomplete,
        error=error,
    )


def _terminal_event(response: ResponseObject) -> str:
    # An incomplete response still ends with ``response.completed`` (its status says
    # incomplete), as vLLM does: the SDK's stream helper and the Agents SDK wait for that
    # event to hand out the final response.
    return "response.failed" if response.status == "failed" else "response.completed"


def _parser(plan: OutputPlan) -> ChoiceParser | None:
    return ChoiceParser(plan) if plan.active else None


async def response_body(ctx: ResponsesContext, deltas: AsyncIterator[Delta]) -> bytes:
    """A whole (non-streaming) response."""
    tally = _Tally(ctx.prompt_len)
    texts: list[str] = []
    async for delta in deltas:
        tally.add(delta)
        if delta.text:
            texts.append(delta.text)
    builder = OutputBuilder(None)
    text = "".join(texts)
    parser = _parser(ctx.plan)
    if parser is None:
        builder.feed(Parsed(content=text))
    else:
        builder.feed(parser.feed(text))
        builder.feed(parser.finish())
    response = _finished(ctx, builder, tally, tally.finish)
    body = _ENCODER.encode(response)
    if ctx.on_done is not None and response.status != "failed":
        ctx.on_done(response, body)
    return body


class ResponseChunks:
    """One streamed response's encoder (``rankgate.app.respond.sse.ChunkEncoder``): the events each
    delta adds, the terminal event last, and ``response.failed`` for a failure."""

    __slots__ = ("_builder", "_ctx", "_events", "_parser", "_started", "_tally", "_text_head")

    def __init__(self, ctx: ResponsesContext) -> None:
        self._ctx = ctx
        self._events = _Events()
        self._builder = OutputBuilder(self._events)
        self._parser = _parser(ctx.plan)
        self._tally = _Tally(ctx.prompt_len)
        self._started = False

    def _start(self) -> None:
        self._started = True
        base = self._ctx.base
        self._events.emit("response.created", {"response": base})
        self._events.emit("response.in_progress", {"response": base})

    def chunk(self, delta: Delta) -> bytes:
        if not self._started:
            self._start()
        self._tally.add(delta)
        builder = self._builder
        parser = self._parser
        if parser is None:
            if delta.text:
                builder.text("message", delta.text)
        else:
            builder.feed(parser.feed(delta.text))
            if delta.finish_reason is not None:
                builder.feed(parser.finish())
        return self._events.take()

    def tail(self) -> bytes:
        if not self._started:
            self._start()
        ctx = self._ctx
        response = _finished(ctx, self._builder, self._tally, self._tally.finish)
        if ctx.on_done is not None and response.status != "failed":
            ctx.on_done(response, _ENCODER.encode(response))
        self._events.emit(_terminal_event(response), {"response": response})
        return self._events.take()

    def error(self, exc: Exception) -> tuple[int, bytes]:
        """A failure after the stream began: an ``error`` event, then ``response.failed``
        with the output so far."""
        api = as_api_error(exc)
        if not self._started:
            self._start()
        self._builder.close("incomplete")
        events = self._events
        events.emit("error", {"code": api.code, "message": api.message, "param": api.param})
        response = msgspec.structs.replace(
            self._ctx.base,
            status="failed",
            output=self._builder.items,
            error=ResponseErrorOut(code=api.code or "server_error", message=api.message),
        )
        events.emit("response.failed", {"response": response})
        return api.status, events.take()


def output_message(items: list[OutputItem]) -> AssistantMessage:
    """A response's output as the assistant message a follow-up's conversation holds."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for item in items:
        if isinstance(item, MessageOut):
            texts.extend(part.text for part in item.content)
        elif isinstance(item, ReasoningOut):
            reasoning.extend(part.text for part in item.content)
        else:
            calls.append(
                ToolCall(
                    id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
                )
            )
    return AssistantMessage(
        content="".join(texts) if texts or not calls else None,
        tool_calls=calls or None,
        reasoning_content="".join(reasoning) or None,
    )


def stored_conversation(
    conversation: tuple[Message, ...], response: ResponseObject
) -> tuple[Message, ...]:
    return (*conversation, output_message(response.output))


def initial_response(req: ResponsesRequest, response_id: str, created_at: int) -> ResponseObject:
    """The response as ``response.created`` announces it: no output yet, the request's
    options echoed as OpenAI echoes them."""
    reasoning = None
    if req.reasoning is not None:
        reasoning = ReasoningOptions(effort=req.reasoning.effort)
    return ResponseObject(
        id=response_id,
        created_at=created_at,
        model=req.model,
        status="in_progress",
        output=[],
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        metadata=req.metadata or {},
        parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        reasoning=reasoning,
        store=req.store,
        temperature=1.0 if req.temperature is None else req.temperature,
        text=req.text if req.text is not None else TextConfig(),
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        tools=req.tools or [],
        top_p=1.0 if req.top_p is None else req.top_p,
        user=req.user,
    )
