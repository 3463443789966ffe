"""Images from OpenAI content parts to vLLM ``MediaItem`` inputs with content-hash identities."""

from rankgate.multimodal.errors import ImageError, ImagesOverBudget
from rankgate.multimodal.media import MediaPreparer
from rankgate.multimodal.types import ImageRef, MediaConfig

__all__ = ["ImageError", "ImageRef", "ImagesOverBudget", "MediaConfig", "MediaPreparer"]
