"""The hook through which chat requests' image parts become vLLM media inputs.

The multimodal package supplies the implementation (``multimodal.MediaPreparer``); until one
is installed on the gateway, requests with image parts are refused with a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from multimodal.types import ImageRef
from sidecar.types import EngineInfo, MediaInput


class MediaHook(Protocol):
    def configure(self, info: EngineInfo) -> None:
        """The discovered engine's model decides how many tokens an image becomes."""

    async def prepare(self, images: Sequence[ImageRef]) -> tuple[MediaInput, ...]: ...

    def observe(
        self, media: Sequence[MediaInput], prompt_len: int, expanded_prompt_tokens: int
    ) -> None:
        """vLLM's expanded prompt length teaches the token counts of images it has seen."""


# Tokens that commonly stand for "one image here" in chat templates, most specific first.
IMAGE_PLACEHOLDERS = ("<|image|>", "<|image_pad|>", "<image>", "<|IMAGE|>", "[IMG]")
