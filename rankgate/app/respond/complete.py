"""Non-streaming responses: gather every choice's deltas, then encode one body."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from rankgate.app.parsers import ChoiceParser, Parsed
from rankgate.app.respond.context import ResponseContext
from rankgate.app.respond.logprobs import LogprobFormatter
from rankgate.app.respond.usage import UsageCounter
from rankgate.app.schemas.responses import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallOut,
    PromptLogprobs,
    ToolCallOut,
)
from rankgate.sidecar import Delta, TokenLogprob

_ENCODER = msgspec.json.Encoder()


class _Choice:
    __slots__ = (
        "finish_reason",
        "kv_transfer_params",
        "logprobs",
        "prompt_logprobs",
        "prompt_token_ids",
        "stop_reason",
        "text",
    )

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self.prompt_token_ids: tuple[int, ...] = ()


async def _gather(
    ctx: ResponseContext, deltas: AsyncIterator[Delta]
) -> tuple[list[_Choice], UsageCounter]:
    choices = [_Choice() for _ in range(ctx.choices)]
    usage = UsageCounter(ctx)
    output = not ctx.echo_only
    async for delta in deltas:
        usage.add(delta)
        choice = choices[delta.index]
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
            choice.prompt_token_ids = delta.prompt_token_ids or ()
        if output:
            if delta.text:
                choice.text.append(delta.text)
            if delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
            choice.kv_transfer_params = delta.kv_transfer_params
    return choices, usage


def _transfer_params(choices: list[_Choice]) -> Any:
    for choice in choices:
        if choice.kv_transfer_params is not None:
            return choice.kv_transfer_params
    return msgspec.UNSET


async def chat_completion(ctx: ResponseContext, deltas: AsyncIterator[Delta]) -> bytes:
    gathered, usage = await _gather(ctx, deltas)
    choices: list[ChatChoice] = []
    for index, choice in enumerate(gathered):
        text = "".join(choice.text)
        message = ChatMessageOut(content=text)
        finish = choice.finish_reason
        if ctx.plan.active:
            parser = ChoiceParser(ctx.plan)
            parsed = parser.feed(text)
            tail = parser.finish()
            forced = ctx.plan.named or ctx.plan.required
            message = _parsed_message(parsed, tail, forced=forced)
            finish = parser.finish_reason(finish, streamed=False)
        logprobs: ChatLogprobs | None = None
        if ctx.logprobs is not None:
            entries: list[ChatTokenLogprob] = ctx.logprobs.chat(choice.logprobs)
            logprobs = ChatLogprobs(content=entries)
        choices.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=choice.stop_reason,
            )
        )
    body = ChatCompletion(
        id=ctx.response_id,
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        usage=usage.usage(),
        kv_transfer_params=_transfer_params(gathered),
    )
    if ctx.prompt_logprobs is not None:
        # One prompt, so one list, at the top as vLLM puts it (every choice's is the same).
        body.prompt_logprobs = _prompt_logprobs(ctx, gathered[0])
    return _ENCODER.encode(body)


def _parsed_message(head: Parsed, tail: Parsed, *, forced: bool) -> ChatMessageOut:
    reasoning = head.reasoning + tail.reasoning
    content = head.content + tail.content
    calls: dict[int, list[str]] = {}
    names: dict[int, tuple[str, str]] = {}
    for call in (*head.calls, *tail.calls):
        if call.id is not None and call.name is not None:
            names[call.index] = (call.id, call.name)
        calls.setdefault(call.index, []).append(call.arguments)
    tool_calls = [
        ToolCallOut(
            id=names[i][0],
            function=FunctionCallOut(name=names[i][1], arguments="".join(calls[i])),
        )
        for i in sorted(names)
    ]
    # As vLLM answers: no text is null content, except under a forcing tool_choice.
    message = ChatMessageOut(content=content if content or forced else None)
    if tool_calls:
        message.tool_calls = tool_calls
    if reasoning:
        message.reasoning_content = reasoning
    return message


async def completion(ctx: ResponseContext, deltas: AsyncIterator[Delta]) -> bytes:
    gathered, usage = await _gather(ctx, deltas)
    choices: list[CompletionChoice] = []
    for index, choice in enumerate(gathered):
        prefix = ctx.echo[index // ctx.n] if ctx.echo is not None else ""
        logprobs: CompletionLogprobs | None = None
        if ctx.logprobs is not None:
            logprobs = _completion_logprobs(ctx.logprobs, choice, prefix, echo=ctx.echo is not None)
        out = CompletionChoice(
            index=index,
            text=prefix + "".join(choice.text),
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )
        if ctx.prompt_logprobs is not None:
            out.prompt_logprobs = _prompt_logprobs(ctx, choice)
        choices.append(out)
    body = Completion(
        id=ctx.response_id,
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        usage=usage.usage(),
        kv_transfer_params=_transfer_params(gathered),
    )
    return _ENCODER.encode(body)


def _completion_logprobs(
    fmt: LogprobFormatter, choice: _Choice, prefix: str, *, echo: bool
) -> CompletionLogprobs:
    """The choice's ``logprobs``; an echoed prompt's own come first, as in vLLM."""
    logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    lists = (logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset)
    offset = len(prefix)
    if echo and choice.prompt_logprobs is not None:
        offset = fmt.completion_prompt(choice.prompt_token_ids, choice.prompt_logprobs, *lists)
    fmt.completion(choice.logprobs, offset, *lists)
    return logprobs


def _prompt_logprobs(ctx: ResponseContext, choice: _Choice) -> PromptLogprobs | None:
    fmt = ctx.prompt_logprobs
    if fmt is None or choice.prompt_logprobs is None:
        return None
    return fmt.prompt(choice.prompt_logprobs)
