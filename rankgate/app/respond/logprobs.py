"""Engine token logprobs in OpenAI's two formats (chat ``content`` list, legacy completions)."""

from __future__ import annotations

from collections.abc import Sequence

from rankgate.app.schemas.responses import (
    ChatTokenLogprob,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from rankgate.app.tokens.tokenizer import TextTokenizer
from rankgate.sidecar import TokenLogprob

# JSON has no -inf; vLLM clamps to this value too.
_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if value > _FLOOR else _FLOOR


class LogprobFormatter:
    __slots__ = ("_as_ids", "_tok", "top")

    def __init__(self, tokenizer: TextTokenizer, top: int, tokens_as_ids: bool) -> None:
        self._tok = tokenizer
        self.top = top
        self._as_ids = tokens_as_ids

    def token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._tok.token_bytes(token_id)
        text = f"token_id:{token_id}" if self._as_ids else raw.decode("utf-8", "replace")
        return text, list(raw)

    def chat(self, entries: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
        out: list[ChatTokenLogprob] = []
        for entry in entries:
            text, raw = self.token(entry.token_id)
            tops: list[TopLogprob] = []
            for token_id, logprob, _rank in entry.top[: self.top]:
                top_text, top_raw = self.token(token_id)
                tops.append(TopLogprob(token=top_text, logprob=_finite(logprob), bytes=top_raw))
            out.append(
                ChatTokenLogprob(
                    token=text, logprob=_finite(entry.logprob), bytes=raw, top_logprobs=tops
                )
            )
        return out

    def completion(
        self,
        entries: Sequence[TokenLogprob],
        offset: int,
        tokens: list[str],
        token_logprobs: list[float | None],
        top_logprobs: list[dict[str, float] | None],
        text_offset: list[int],
    ) -> int:
        """Append one delta's entries to the four lists; returns the new text offset."""
        for entry in entries:
            text, _ = self.token(entry.token_id)
            tokens.append(text)
            token_logprobs.append(_finite(entry.logprob))
            tops: dict[str, float] = {}
            for token_id, logprob, _rank in entry.top[: self.top]:
                tops[self.token(token_id)[0]] = _finite(logprob)
            tops.setdefault(text, _finite(entry.logprob))
            top_logprobs.append(tops)
            text_offset.append(offset)
            offset += len(text)
        return offset

    def completion_prompt(
        self,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprob | None],
        tokens: list[str],
        token_logprobs: list[float | None],
        top_logprobs: list[dict[str, float] | None],
        text_offset: list[int],
    ) -> int:
        """An echoed prompt's entries, first in ``logprobs`` as vLLM writes them: the first
        token has null logprobs. Offsets count from the prompt's start; returns the next."""
        offset = 0
        for token_id, entry in zip(token_ids, entries, strict=True):
            if entry is None:
                text, _ = self.token(token_id)
                tokens.append(text)
                token_logprobs.append(None)
                top_logprobs.append(None)
                text_offset.append(offset)
                offset += len(text)
            else:
                offset = self.completion(
                    (entry,), offset, tokens, token_logprobs, top_logprobs, text_offset
                )
        return offset

    def prompt(self, entries: Sequence[TokenLogprob | None]) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs``: each position's own token and its top candidates."""
        out: PromptLogprobs = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            ranked = {
                str(entry.token_id): PromptLogprob(
                    logprob=_finite(entry.logprob),
                    rank=entry.rank,
                    decoded_token=self.token(entry.token_id)[0],
                )
            }
            for token_id, logprob, rank in entry.top[: self.top]:
                key = str(token_id)
                if key not in ranked:
                    ranked[key] = PromptLogprob(
                        logprob=_finite(logprob), rank=rank, decoded_token=self.token(token_id)[0]
                    )
            out.append(ranked)
        return out
