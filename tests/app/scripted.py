"""An engine that answers with scripted text, for checking the response side exactly.

It implements the gateway's ``Engine`` protocol with real token ids and logprobs from the
tiny tokenizer, so parsers, logprobs, usage and mid-stream failures can be asserted to the
byte through HTTP.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from rankgate.app.tokens.tokenizer import TextTokenizer
from rankgate.sidecar import merge_batch
from rankgate.sidecar.errors import SidecarError
from rankgate.sidecar.types import Delta, EngineInfo, PreparedRequest, RankCapacity, TokenLogprob

SCRIPTED_MODEL = "scripted"


def scripted_info(tokenizer_dir: Path, *, tool_parser: str = "", reasoning: str = "") -> EngineInfo:
    return EngineInfo(
        model_id=str(tokenizer_dir),
        served_model_name=SCRIPTED_MODEL,
        aliases=("scripted-alias",),
        engine_version="0.32.0",
        instance_id="scripted-1",
        max_model_len=256,
        block_size=16,
        dp_size=2,
        ranks=(0, 1),
        capacity=(RankCapacity(0, 100, 8), RankCapacity(1, 100, 8)),
        max_batched_tokens=1024,
        supports_text_input=True,
        supports_lora=True,
        supports_multimodal=False,
        reasoning_parser=reasoning,
        tool_call_parser=tool_parser,
    )


class ScriptedEngine:
    def __init__(self, info: EngineInfo, tokenizer_dir: Path) -> None:
        self._info = info
        self._tok = TextTokenizer(tokenizer_dir)
        self.ready = True
        # Choice i answers outputs[i % len(outputs)]; the request's text splits into
        # one delta per token.
        self.outputs: list[str] = ["Hello there."]
        self.finish_reason: str = "stop"
        # Raise this error after that many deltas of choice 0 (None: never).
        self.fail_after: tuple[int, SidecarError] | None = None
        self.loras: tuple[str, ...] = ("my-lora",)
        self.requests: deque[PreparedRequest] = deque(maxlen=64)
        self.closed = 0
        # Of those, the streams closed before their last delta: dropped, or failed.
        self.cut = 0
        # Seconds between deltas.
        self.delay = 0.0

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def admission(self) -> None:
        return None

    async def list_loras(self) -> tuple[str, ...]:
        return self.loras

    def generate_batch(self, requests: Sequence[PreparedRequest], n: int) -> AsyncIterator[Delta]:
        return merge_batch([self.generate(request) for request in requests], n)

    async def close(self) -> None:
        return None

    async def generate(self, request: PreparedRequest) -> AsyncIterator[Delta]:
        self.requests.append(request)
        whole = False
        try:
            for choice in range(request.n):
                text = self.outputs[choice % len(self.outputs)]
                ids = self._tok.encode(text, False) or [0]
                sent = ""
                for position, token in enumerate(ids):
                    if (
                        self.fail_after is not None
                        and choice == 0
                        and position == self.fail_after[0]
                    ):
                        raise self.fail_after[1]
                    # Like vLLM's detokenizer, a token ending inside a character waits.
                    decoded = self._tok.decode(ids[: position + 1])
                    piece = ""
                    if not decoded.endswith("\ufffd") or position == len(ids) - 1:
                        piece, sent = decoded[len(sent) :], decoded
                    delta = Delta(index=choice, text=piece, token_ids=(token,))
                    if position == 0:
                        delta.prompt_tokens = len(request.prompt_token_ids)
                    if request.output.logprobs is not None:
                        top = tuple(
                            (token + k, -0.5 * (k + 1), k + 1)
                            for k in range(request.output.logprobs)
                        )
                        delta.logprobs = (TokenLogprob(token, -0.25, 1, top),)
                    if position == len(ids) - 1:
                        delta.finish_reason = self.finish_reason  # type: ignore[assignment]
                        delta.completion_tokens = len(ids)
                        delta.stop_reason = None
                    yield delta
                    await asyncio.sleep(self.delay)
            whole = True
        finally:
            self.closed += 1
            self.cut += not whole
