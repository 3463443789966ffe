"""The hook through which chat requests' image parts become vLLM media inputs.

The multimodal package supplies the implementation (``multimodal.MediaPreparer``); until one
is installed on the gateway, requests with image parts are refused with a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from multimodal.types import ImageRef
from sidecar.types import MediaInput


class MediaHook(Protocol):
    async def prepare(self, images: Sequence[ImageRef]) -> tuple[MediaInput, ...]: ...


# Tokens that commonly stand for "one image here" in chat templates, most specific first.
IMAGE_PLACEHOLDERS = ("<|image|>", "<|image_pad|>", "<image>", "<|IMAGE|>", "[IMG]")
