"""Runs vLLM's own output parsers on a corpus, for the differential tests.

This file is executed by the Python of the vLLM install that ``scripts/real-vllm`` manages
(vLLM and torch live there, not in Rankgate's environment), so it imports nothing from
Rankgate. It reads one JSON request per line on stdin and answers one JSON line on stdout:

    {"tokenizer": dir | "harmony", "tool_parser": name | null, "reasoning_parser": name | null,
     "tools": [...], "tool_choice": ..., "parallel_tool_calls": bool | null,
     "prompt": text | null, "text": text, "chunkings": [seed, ...]}

and answers ``{"whole": result, "streams": [{"pieces": [...], "result": result}, ...]}``, a
result being ``{"reasoning", "content", "calls": [[name, arguments, id], ...]}`` as vLLM's
server would put it in a response (the non-streamed) or as a client would assemble it from
the deltas (the streamed). A chunking seed of 0 means one token per delta; any other seeds a
random grouping of 1 to 6 tokens per delta. The text pieces of each chunking are returned,
so the caller feeds Rankgate exactly what vLLM was fed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import traceback
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
logging.disable(logging.WARNING)

from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
)
from vllm.entrypoints.serve.utils.tool_calls_utils import (  # noqa: E402
    maybe_filter_parallel_tool_calls,
)
from vllm.parser import ParserManager  # noqa: E402

_TOKENIZERS: dict[str, Any] = {}


class _HarmonyTokenizer:
    """The o200k_harmony encoding behind the small tokenizer interface the parsers use."""

    def __init__(self) -> None:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        self.encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.encoding.encode(text, allowed_special="all"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.encoding.decode(ids))

    def get_vocab(self) -> dict[str, int]:
        return {}


def _tokenizer(name: str) -> Any:
    tok = _TOKENIZERS.get(name)
    if tok is None:
        if name == "harmony":
            tok = _HarmonyTokenizer()
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(name)
        _TOKENIZERS[name] = tok
    return tok


def _request(spec: dict[str, Any]) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "model": "m"}
    if spec.get("tools"):
        body["tools"] = spec["tools"]
    if spec.get("tool_choice") is not None:
        body["tool_choice"] = spec["tool_choice"]
    if spec.get("parallel_tool_calls") is not None:
        body["parallel_tool_calls"] = spec["parallel_tool_calls"]
    if spec.get("chat_template_kwargs"):
        body["chat_template_kwargs"] = spec["chat_template_kwargs"]
    return ChatCompletionRequest(**body)


def _parser(spec: dict[str, Any], tok: Any, request: ChatCompletionRequest) -> Any:
    tool = spec.get("tool_parser")
    reasoning = spec.get("reasoning_parser")
    cls = ParserManager.get_parser(
        tool_parser_name=tool,
        reasoning_parser_name=reasoning,
        enable_auto_tools=tool is not None,
        is_harmony=tool == "openai" or reasoning == "openai_gptoss",
    )
    kwargs = {"chat_template_kwargs": spec.get("chat_template_kwargs") or {}}
    return cls(tok, request.tools, model_config=None, **kwargs)


def _adjust(spec: dict[str, Any], parser: Any, request: ChatCompletionRequest) -> Any:
    """The renderer's call: only with a reasoning parser or a tool_choice other than none."""
    if spec.get("reasoning_parser") or request.tool_choice not in (None, "none"):
        return parser.adjust_request(request)
    return request


def _named(request: ChatCompletionRequest) -> bool:
    return type(request.tool_choice) is ChatCompletionNamedToolChoiceParam


def _whole(spec: dict[str, Any], tok: Any, prompt_ids: list[int] | None) -> dict[str, Any]:
    """The message vLLM's chat server builds from the whole output (its non-streaming path)."""
    request = _request(spec)
    parser = _parser(spec, tok, request)
    request = _adjust(spec, parser, request)
    text = spec["text"]
    ids = tok.encode(text, add_special_tokens=False)
    if prompt_ids is not None:
        parser.set_prompt_token_ids(prompt_ids)
    reasoning, content, calls = parser.parse(
        text,
        request,
        enable_auto_tools=spec.get("tool_parser") is not None,
        model_output_token_ids=ids,
    )
    named = _named(request)
    required = request.tool_choice == "required"
    calls = list(calls or [])
    auto_tools = spec.get("tool_parser") is not None
    if named or required:
        content = content or ""
    elif (
        not auto_tools
        or request.tool_choice in (None, "none")
        or not (request.tools and request.tool_choice == "auto")
    ):
        calls = []
    if request.parallel_tool_calls is False:
        calls = calls[:1]
    return {
        "reasoning": reasoning,
        "content": content,
        "calls": [[c.name, c.arguments, c.id] for c in calls],
        "finish": _finish(request, bool(calls), stream=False),
    }


def _finish(request: ChatCompletionRequest, called: bool, *, stream: bool) -> str:
    if stream:
        return "tool_calls" if called and not _named(request) else "stop"
    if called and (request.tool_choice in (None, "auto")):
        return "tool_calls"
    return "tool_calls" if request.tool_choice == "required" else "stop"


def _groups(tok: Any, ids: list[int], seed: int) -> list[tuple[list[int], str]]:
    """Deltas of token ids with their text, as vLLM's detokenizer would hand them out
    (a group that ends inside a multi-byte character waits for the next token)."""
    rng = random.Random(seed)
    out: list[tuple[list[int], str]] = []
    start = 0
    sent = ""
    pos = 0
    while pos < len(ids):
        pos = min(len(ids), pos + (1 if seed == 0 else rng.randint(1, 6)))
        text = tok.decode(ids[:pos], skip_special_tokens=False)
        if text.endswith("\ufffd") and pos < len(ids):
            continue
        out.append((ids[start:pos], text[len(sent) :]))
        sent = text
        start = pos
    return out


def _stream(
    spec: dict[str, Any], tok: Any, prompt_ids: list[int] | None, seed: int
) -> dict[str, Any]:
    request = _request(spec)
    parser = _parser(spec, tok, request)
    request = _adjust(spec, parser, request)
    ids = tok.encode(spec["text"], add_special_tokens=False)
    groups = _groups(tok, ids, seed)
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    order: list[int] = []
    called = False
    for n, (delta_ids, delta_text) in enumerate(groups):
        delta = parser.parse_delta(
            delta_text,
            delta_ids,
            request,
            prompt_token_ids=prompt_ids or [],
            finished=n == len(groups) - 1,
        )
        if delta is None:
            continue
        if delta.tool_calls:
            called = True
            delta = maybe_filter_parallel_tool_calls(delta, request)
        if delta.reasoning:
            reasoning.append(delta.reasoning)
        if delta.content:
            content.append(delta.content)
        for call in delta.tool_calls or []:
            slot = calls.get(call.index)
            if slot is None:
                slot = calls[call.index] = ["", "", ""]
                order.append(call.index)
            if call.id:
                slot[2] = call.id
            if call.function is not None:
                if call.function.name:
                    slot[0] += call.function.name
                if call.function.arguments:
                    slot[1] += call.function.arguments
    return {
        "pieces": [text for _, text in groups],
        "result": {
            "reasoning": "".join(reasoning) or None,
            "content": "".join(content) or None,
            "calls": [calls[i] for i in order],
            "finish": _finish(request, called, stream=True),
        },
    }


def _constraint(spec: dict[str, Any], tok: Any) -> dict[str, Any]:
    """What vLLM's renderer sends the engine for this request once the parser adjusted it:
    the structured-output constraint (JSON schema or structural tag) and skip_special_tokens."""
    request = _request(spec)
    parser = _parser(spec, tok, request)
    request = _adjust(spec, parser, request)
    so = request.structured_outputs
    out: dict[str, Any] = {"skip_special_tokens": request.skip_special_tokens}
    if so is not None:
        if so.json is not None:
            out["json"] = so.json if isinstance(so.json, dict) else json.loads(so.json)
        if so.structural_tag is not None:
            out["structural_tag"] = json.loads(so.structural_tag)
    return out


def handle(spec: dict[str, Any]) -> dict[str, Any]:
    tok = _tokenizer(spec["tokenizer"])
    if spec.get("op") == "constraint":
        return _constraint(spec, tok)
    prompt = spec.get("prompt")
    prompt_ids = tok.encode(prompt, add_special_tokens=False) if prompt is not None else None
    out: dict[str, Any] = {}
    try:
        out["whole"] = _whole(spec, tok, prompt_ids)
    except Exception as exc:  # vLLM's own failure is a fact to report, not a driver crash
        out["whole"] = {"error": f"{type(exc).__name__}: {exc}"}
    streams = []
    for seed in spec.get("chunkings", [0]):
        try:
            streams.append(_stream(spec, tok, prompt_ids, seed))
        except Exception as exc:
            streams.append(
                {
                    "pieces": [t for _, t in _groups(tok, tok.encode(spec["text"]), seed)],
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(limit=3),
                }
            )
    out["streams"] = streams
    return out


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything vLLM prints must not corrupt the answers
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = handle(json.loads(line))
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(answer, ensure_ascii=False), file=out, flush=True)


if __name__ == "__main__":
    main()
