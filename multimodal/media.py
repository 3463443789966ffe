"""OpenAI image parts to :class:`~sidecar.types.MediaInput`: the package's one entry point."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from rankgate.multimodal.addresses import AddressPolicy, Resolver
from rankgate.multimodal.decode import DecodedImage, DecodeLimits, ImageDecoder
from rankgate.multimodal.errors import ImageError, ImageRefused, ImagesOverBudget
from rankgate.multimodal.expansion import ImageTokenFormula, LearnedTokenCounts, formula_for
from rankgate.multimodal.fetch import ImageFetcher, parse_url
from rankgate.multimodal.identity import url_identity
from rankgate.multimodal.types import ImageRef, MediaConfig
from rankgate.sidecar.types import EngineInfo, MediaInput

_DETAILS = frozenset({"auto", "low", "high"})
_T = TypeVar("_T")


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

    async def prepare(
        self, images: Sequence[ImageRef], token_budget: int | None = None
    ) -> tuple[MediaInput, ...]:
        """One :class:`MediaInput` per image, in order; raises :class:`ImageError`.

        Images with the same URL text are fetched and decoded once. On the first refusal the
        other images' work is cancelled and the refusal with the lowest index is raised.

        With a ``token_budget`` (the tokens the context leaves for the images), the images
        are counted from their headers once all are fetched, and refused together
        (:class:`ImagesOverBudget`) before any pixel is decoded when they surely expand past
        it: decoding is the expensive part, in time and memory.
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
        sources, failure = await self._each(first_index, self._source)
        if failure is not None:
            # An earlier image that only its decoding refuses is still the one to report.
            earlier = {url: i for url, i in first_index.items() if i < failure.index}
            _, decoded = await self._each(earlier, lambda i, url: self._decode(i, sources[url]))
            raise decoded or failure
        if token_budget is not None:
            await self._check_budget(images, first_index, sources, token_budget)
        loaded, failure = await self._each(
            first_index, lambda index, url: self._decode(index, sources[url])
        )
        if failure is not None:
            raise failure
        return tuple(
            self._media_input(index, ref, loaded[ref.url]) for index, ref in enumerate(images)
        )

    async def _each(
        self,
        first_index: dict[str, int],
        work: Callable[[int, str], Awaitable[_T]],
    ) -> tuple[dict[str, _T], ImageError | None]:
        """``work`` for every distinct image concurrently: the results by URL, and the
        lowest-index refusal (then the results hold every image before it).

        After a refusal, work on later images is cancelled at once, while earlier ones run on
        because one of them may fail too: the error a client sees does not depend on timing.
        """
        tasks = {
            asyncio.ensure_future(work(index, url)): index for url, index in first_index.items()
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
            by_index = {
                index: task.result()
                for task, index in tasks.items()
                if first is None or index < first.index
            }
            results = {url: by_index[i] for url, i in first_index.items() if i in by_index}
            return results, first
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _check_budget(
        self,
        images: Sequence[ImageRef],
        first_index: dict[str, int],
        sources: dict[str, bytes | str],
        budget: int,
    ) -> None:
        """Refuse when the images' fewest possible tokens pass ``budget``: a count learnt for
        the client's uuid, else the formula (or a count learnt for that size) at the header's
        size in either orientation (EXIF may turn it), else one token (the placeholder) for
        an image nothing is known about."""

        async def size(index: int, url: str) -> tuple[int, int] | None:
            source = sources[url]
            if isinstance(source, str):
                return None
            try:
                return await self.decoder.size(source)
            except ImageRefused as refusal:
                raise refusal.at(index) from None

        sizes, failure = await self._each(first_index, size)
        if failure is not None:
            raise failure
        total = 0
        for index, ref in enumerate(images):
            learned = self.learned.get(ref.uuid) if ref.uuid else None
            dimensions = sizes[ref.url]
            if learned is not None:
                total += learned
            elif dimensions is not None and self._formula is not None:
                width, height = dimensions
                try:
                    total += min(
                        self._formula.tokens(width, height), self._formula.tokens(height, width)
                    )
                except ImageRefused as refusal:
                    raise refusal.at(index) from None
            elif dimensions is not None:
                # Without a formula, a count learnt for an image of this size (EXIF may turn
                # it, so only when both orientations are known).
                width, height = dimensions
                upright = self.learned.for_size(width, height)
                turned = self.learned.for_size(height, width)
                total += min(upright, turned) if upright and turned else 1
            else:
                total += 1
        if total > budget:
            raise ImagesOverBudget(total, budget)

    async def _source(self, index: int, url: str) -> bytes | str:
        """The image's bytes, or the URL itself when vLLM is to fetch it (pass-through)."""
        try:
            if url[:5].lower() == "data:":
                return await self.decoder.data_uri_bytes(url, self.config.max_image_bytes)
            if self.config.mode == "passthrough":
                parse_url(url)
                return url
            return await self.fetcher.fetch(url)
        except ImageRefused as refusal:
            raise refusal.at(index) from None

    async def _decode(self, index: int, source: bytes | str) -> DecodedImage | str:
        if isinstance(source, str):
            return source
        try:
            return await self.decoder.decode(source)
        except ImageRefused as refusal:
            raise refusal.at(index) from None

    def observe(
        self,
        media: Sequence[MediaInput],
        prompt_len: int,
        expanded_prompt_tokens: int,
        expanded_ids: Sequence[int] | None = None,
    ) -> None:
        """Learn token counts from vLLM's first answer: per image from the expanded ids
        (``Delta.prompt_token_ids``) when present, else from ``Delta.prompt_tokens``."""
        if expanded_ids and self.learned.observe_runs(media, prompt_len, expanded_ids):
            return
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
        self.learned.saw(uuid, image.width, image.height)
        if learned is not None:
            return learned
        if self._formula is None:
            return self.learned.for_size(image.width, image.height)
        try:
            return self._formula.tokens(image.width, image.height)
        except ImageRefused as refusal:
            raise refusal.at(index) from None

    async def aclose(self) -> None:
        await self.fetcher.aclose()
        self.decoder.close()
