"""Images from OpenAI content parts to vLLM ``MediaItem`` inputs with content-hash identities."""

from multimodal.errors import ImageError
from multimodal.media import MediaPreparer
from multimodal.types import ImageRef, MediaConfig

__all__ = ["ImageError", "ImageRef", "MediaConfig", "MediaPreparer"]
