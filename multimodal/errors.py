"""The one error type of this package: an image the gateway refuses, and why."""

from __future__ import annotations


class ImageError(Exception):
    """A refused image. ``index`` is the image's 0-based position among the request's images.

    The app maps it to an OpenAI error body with ``status`` (400 unless stated) and
    :attr:`message`, which names the image so a client with many images knows which one failed.
    """

    def __init__(self, index: int, reason: str, status: int = 400) -> None:
        self.index = index
        self.reason = reason
        self.status = status
        self.message = f"image {index}: {reason}"
        super().__init__(self.message)


class ImageRefused(Exception):
    """Raised below :class:`~multimodal.media.MediaPreparer`, which knows no index yet.

    The preparer turns it into an :class:`ImageError` for the image being prepared.
    """

    def __init__(self, reason: str, status: int = 400) -> None:
        self.reason = reason
        self.status = status
        super().__init__(reason)

    def at(self, index: int) -> ImageError:
        return ImageError(index, self.reason, self.status)


class ImagesOverBudget(ImageError):
    """The request's images, counted from their headers, expand past the tokens its context
    has left for them; refused before any image is decoded. ``tokens``: the fewest tokens
    they can expand to."""

    def __init__(self, tokens: int, budget: int) -> None:
        super().__init__(
            0,
            f"the images expand to at least {tokens} tokens, more than the {max(budget, 0)} "
            "the context leaves for them",
        )
        self.tokens = tokens
