"""Images, audio and video from OpenAI content parts to vLLM ``MediaItem`` inputs with
content-hash identities."""

from rankgate.multimodal.errors import MediaError, MediaOverBudget
from rankgate.multimodal.media import MediaPreparer
from rankgate.multimodal.types import MediaConfig, MediaKind, MediaRef

__all__ = [
    "MediaConfig",
    "MediaError",
    "MediaKind",
    "MediaOverBudget",
    "MediaPreparer",
    "MediaRef",
]
