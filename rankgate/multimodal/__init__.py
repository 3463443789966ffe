"""Images, audio and video from OpenAI content parts to vLLM ``MediaItem`` inputs with
content-hash identities.

The names below are imported on first use, so that a decoder process
(:mod:`rankgate.multimodal.worker`) loads Pillow and FFmpeg without the preparer's HTTP client
and the engine types it never uses, and starts in a fraction of the time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

_HOMES = {
    "MediaConfig": "rankgate.multimodal.types",
    "MediaError": "rankgate.multimodal.errors",
    "MediaKind": "rankgate.multimodal.types",
    "MediaOverBudget": "rankgate.multimodal.errors",
    "MediaPreparer": "rankgate.multimodal.media",
    "MediaRef": "rankgate.multimodal.types",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
