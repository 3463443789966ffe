"""OpenAI image parts to :class:`~sidecar.types.MediaInput`: the package's one entry point."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from multimodal.addresses import AddressPolicy, Resolver
from multimodal.decode import DecodedImage, DecodeLimits, ImageDecoder
from multimodal.errors import ImageError, ImageRefused
from multimodal.expansion import ImageTokenFormula, LearnedTokenCounts, formula_for
from multimodal.fetch import ImageFetcher
from multimodal.identity import url_identity
from multimodal.types import ImageRef, MediaConfig
from sidecar.types import EngineInfo, MediaInput

_DETAILS = frozenset({"auto", "low", "high"})


class MediaPreparer:
    """Fetches, validates, decodes and identifies a request's images, all concurrently.

    Build one per process and share it: it owns the HTTP client, the fetch cache, the decode
    pool and the learned token counts. ``model_id`` picks the token-count formula (see
    :mod:`multimodal.expansion`); the app reports vLLM's expanded prompt lengths through
    :meth:`observe` so that other models' counts are learnt.
    """

    def __init__(
        self,
        config: MediaConfig | None = None,
        *,
        model_id: str = "",
        resolver: Resolver | None = None,
    ) -> None:
        self.config = config or MediaConfig()
        self._policy = AddressPolicy(self.config.allowed_networks, resolver)
        self.fetcher = ImageFetcher(self.config, self._policy)
        self.decoder = ImageDecoder(
            DecodeLimits(self.config.allowed_formats, self.config.max_pixels),
            self.config.decode_workers,
            self.config.decode_memo_bytes,
        )
        self.learned = LearnedTokenCounts(self.config.learned_token_entries)
        self._formula: ImageTokenFormula | None = None
        self.set_model(model_id)

    def set_model(self, model_id: str) -> None:
        self._formula = formula_for(self.config, model_id)

    def configure(self, info: EngineInfo) -> None:
        """Adopt a discovered engine's model: it selects the token-count formula."""
        self.set_model(info.model_id)

    @property
    def formula(self) -> ImageTokenFormula | None:
        return self._formula

    async def prepare(self, images: Sequence[ImageRef]) -> tuple[MediaInput, ...]:
        """One :class:`MediaInput` per image, in order; raises :class:`ImageError`.

        Images with the same URL text are fetched and decoded once. On the first refusal the
        other images' work is cancelled and the refusal with the lowest index is raised.
        """
        limit = self.config.max_images
        if len(images) > limit:
            raise ImageError(
                limit, f"too many images: the request has {len(images)}, at most {limit} allowed"
            )
        first_index: dict[str, int] = {}
        for index, ref in enumerate(images):
            self._check_ref(index, ref)
            first_index.setdefault(ref.url, index)
        loaded = await self._load_all(first_index)
        return tuple(
            self._media_input(index, ref, loaded[ref.url]) for index, ref in enumerate(images)
        )

    async def _load_all(self, first_index: dict[str, int]) -> dict[str, DecodedImage | str]:
        """Load every distinct image concurrently; raise the lowest-index refusal.

        After a refusal, work on later images is cancelled at once, while earlier ones run on
        because one of them may fail too: the error a client sees does not depend on timing.
        """
        tasks = {
            asyncio.ensure_future(self._load(index, url)): index
            for url, index in first_index.items()
        }
        try:
            pending = set(tasks)
            first: ImageError | None = None
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    failure = task.exception()
                    if failure is None:
                        continue
                    if not isinstance(failure, ImageError):
                        raise failure
                    if first is None or failure.index < first.index:
                        first = failure
                if first is not None:
                    limit = first.index
                    for task in pending:
                        if tasks[task] > limit:
                            task.cancel()
                    pending = {task for task in pending if tasks[task] < limit}
            if first is not None:
                raise first
            by_index = {index: task.result() for task, index in tasks.items()}
            return {url: by_index[index] for url, index in first_index.items()}
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def observe(
        self, media: Sequence[MediaInput], prompt_len: int, expanded_prompt_tokens: int
    ) -> None:
        """Learn token counts from vLLM's first answer (``Delta.prompt_tokens``)."""
        self.learned.observe(media, prompt_len, expanded_prompt_tokens)

    def _check_ref(self, index: int, ref: ImageRef) -> None:
        if ref.detail is not None and ref.detail not in _DETAILS:
            raise ImageError(index, f"detail must be one of auto, low, high; got {ref.detail!r}")
        if ref.uuid is not None:
            if not ref.uuid or len(ref.uuid) > self.config.max_uuid_length:
                raise ImageError(
                    index, f"uuid must be 1 to {self.config.max_uuid_length} characters"
                )
            if not ref.uuid.isascii() or not ref.uuid.isprintable():
                raise ImageError(index, "uuid must be printable ASCII")
        scheme = ref.url[:8].lower()
        if not scheme.startswith(("data:", "http://", "https://")):
            raise ImageError(index, "image url must be a data: URI or an http(s):// URL")

    async def _load(self, index: int, url: str) -> DecodedImage | str:
        """The decoded image, or the URL itself when vLLM is to fetch it (pass-through)."""
        try:
            if url[:5].lower() == "data:":
                return await self.decoder.decode_data_uri(url, self.config.max_image_bytes)
            if self.config.mode == "passthrough":
                return url
            return await self.decoder.decode(await self.fetcher.fetch(url))
        except ImageRefused as refusal:
            raise refusal.at(index) from None

    def _media_input(self, index: int, ref: ImageRef, loaded: DecodedImage | str) -> MediaInput:
        if isinstance(loaded, str):
            uuid = ref.uuid or url_identity(loaded)
            return MediaInput(uuid=uuid, url=loaded, num_tokens=self.learned.get(uuid))
        uuid = ref.uuid or loaded.uuid
        return MediaInput(
            uuid=uuid,
            mime_type=loaded.mime_type,
            data=loaded.data,
            num_tokens=self._count(index, uuid, loaded),
        )

    def _count(self, index: int, uuid: str, image: DecodedImage) -> int | None:
        learned = self.learned.get(uuid)
        if learned is not None or self._formula is None:
            return learned
        try:
            return self._formula.tokens(image.width, image.height)
        except ImageRefused as refusal:
            raise refusal.at(index) from None

    async def aclose(self) -> None:
        await self.fetcher.aclose()
        self.decoder.close()
