"""The hook through which chat requests' media parts become vLLM media inputs.

The multimodal package supplies the implementation (``rankgate.multimodal.MediaPreparer``); until
one is installed on the gateway, requests with media parts are refused with a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rankgate.multimodal import MediaRef
from rankgate.sidecar import EngineInfo, MediaInput


class MediaHook(Protocol):
    def configure(self, info: EngineInfo) -> None:
        """The discovered engine's model decides how many tokens an image becomes."""

    async def prepare(
        self, items: Sequence[MediaRef], token_budget: int | None = None
    ) -> tuple[MediaInput, ...]:
        """The items as media inputs, in order; with ``token_budget``, items that surely
        cannot fit it are refused before any is decoded."""
        ...

    def observe(
        self,
        media: Sequence[MediaInput],
        prompt_len: int,
        expanded_prompt_tokens: int,
        expanded_ids: Sequence[int] | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        """vLLM's expanded prompt teaches the token counts of items it has seen: each item's
        run in ``expanded_ids`` when vLLM returned them, else what the length pins down."""


# Tokens that commonly stand for "one image / audio clip / video here" in chat templates,
# most specific first.
IMAGE_PLACEHOLDERS = ("<|image|>", "<|image_pad|>", "<image>", "<|IMAGE|>", "[IMG]")
AUDIO_PLACEHOLDERS = ("<|audio_pad|>", "<|AUDIO|>", "<|audio|>", "<audio>")
VIDEO_PLACEHOLDERS = ("<|video_pad|>", "<|video|>", "<video>")
