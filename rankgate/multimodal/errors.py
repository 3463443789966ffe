"""The errors of this package: a medium the gateway refuses, and why."""

from __future__ import annotations


class MediaError(Exception):
    """A refused image, audio clip or video. ``index`` is the item's 0-based position among
    the request's media, which orders refusals; ``label`` names it for the client ("image 2",
    "audio 0": the position among the request's items of that kind).

    The app maps it to an OpenAI error body with ``status`` (400 unless stated) and
    :attr:`message`, which names the item so a client with many knows which one failed.
    """

    def __init__(
        self, index: int, reason: str, status: int = 400, label: str | None = None
    ) -> None:
        self.index = index
        self.reason = reason
        self.status = status
        self.label = label or f"image {index}"
        self.message = f"{self.label}: {reason}"
        super().__init__(self.message)


class MediaRefused(Exception):
    """Raised below :class:`~rankgate.multimodal.media.MediaPreparer`, which knows no index yet.

    The preparer turns it into a :class:`MediaError` for the item being prepared.
    """

    def __init__(self, reason: str, status: int = 400) -> None:
        self.reason = reason
        self.status = status
        super().__init__(reason)

    def at(self, index: int, label: str | None = None) -> MediaError:
        return MediaError(index, self.reason, self.status, label)


class MediaOverBudget(MediaError):
    """The request's media, counted before any is decoded, expand past the tokens its context
    has left for them. ``tokens``: the fewest tokens they can expand to."""

    def __init__(self, tokens: int, budget: int) -> None:
        super().__init__(
            0,
            f"the media expand to at least {tokens} tokens, more than the {max(budget, 0)} "
            "the context leaves for them",
        )
        self.tokens = tokens
