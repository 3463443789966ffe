"""OpenAI media parts to :class:`~rankgate.sidecar.types.MediaInput`: the package's one entry
point."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from rankgate.multimodal.addresses import AddressPolicy, Resolver
from rankgate.multimodal.clips import ClipDecoder, ClipLimits, ProbedClip
from rankgate.multimodal.decode import DecodedImage, DecodeLimits, ImageDecoder
from rankgate.multimodal.errors import MediaError, MediaOverBudget, MediaRefused
from rankgate.multimodal.expansion import (
    ImageTokenFormula,
    LearnedTokenCounts,
    formula_for,
    image_shape,
)
from rankgate.multimodal.fetch import ImageFetcher, parse_url
from rankgate.multimodal.identity import url_identity
from rankgate.multimodal.isolation import DEFAULT_HANDLER, DecoderLimits, DecoderPool
from rankgate.multimodal.types import MediaConfig, MediaKind, MediaRef
from rankgate.sidecar.types import EngineInfo, MediaInput

_DETAILS = frozenset({"auto", "low", "high"})
_T = TypeVar("_T")
# One item's work is keyed by its kind and URL text: the same URL as two kinds is two items.
_Key = tuple[MediaKind, str]
_Loaded = DecodedImage | ProbedClip | str


class MediaPreparer:
    """Fetches, validates, decodes and identifies a request's media, all concurrently.

    Build one per process and share it: it owns the HTTP client, the fetch cache, the decoder
    processes (started on the first item to decode) and the learned token counts. ``model_id``
    picks the token-count formula (see :mod:`rankgate.multimodal.expansion`); the app reports
    vLLM's expanded prompt lengths through :meth:`observe` so that other models' counts are
    learnt. ``decoder`` names the function the decoder processes run (``module:function``):
    only tests name another.
    """

    def __init__(
        self,
        config: MediaConfig | None = None,
        *,
        model_id: str = "",
        resolver: Resolver | None = None,
        decoder: str = DEFAULT_HANDLER,
    ) -> None:
        self.config = config or MediaConfig()
        self._policy = AddressPolicy(self.config.allowed_networks, resolver)
        self.fetcher = ImageFetcher(self.config, self._policy)
        self.decoders = DecoderPool(
            DecoderLimits(
                workers=self.config.decode_workers,
                queue=self.config.decode_queue,
                timeout=self.config.decode_timeout,
                cpu_seconds=self.config.decode_cpu_seconds,
                memory_bytes=self.config.decode_memory_bytes,
            ),
            decoder,
        )
        self.decoder = ImageDecoder(
            DecodeLimits(self.config.allowed_formats, self.config.max_pixels),
            self.decoders,
            self.config.decode_memo_bytes,
        )
        self.clips = ClipDecoder(
            ClipLimits(
                kind="audio",
                containers=self.config.allowed_audio_containers,
                max_seconds=self.config.max_audio_seconds,
                max_decoded_bytes=self.config.max_audio_decoded_bytes,
            ),
            ClipLimits(
                kind="video",
                containers=self.config.allowed_video_containers,
                max_seconds=self.config.max_video_seconds,
                max_frames=self.config.max_video_frames,
                max_frame_pixels=self.config.max_video_frame_pixels,
            ),
            self.decoders,
            self.config.decode_memo_bytes,
        )
        self._most: dict[MediaKind, int] = {
            "image": self.config.max_images,
            "audio": self.config.max_audios,
            "video": self.config.max_videos,
        }
        self._max_bytes: dict[MediaKind, int] = {
            "image": self.config.max_image_bytes,
            "audio": self.config.max_audio_bytes,
            "video": self.config.max_video_bytes,
        }
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
        self, items: Sequence[MediaRef], token_budget: int | None = None
    ) -> tuple[MediaInput, ...]:
        """One :class:`MediaInput` per item, in order; raises :class:`MediaError`.

        Items of one kind with the same URL text are fetched and decoded once. On the first
        refusal the other items' work is cancelled and the refusal with the lowest index is
        raised.

        With a ``token_budget`` (the tokens the context leaves for the media), the items are
        counted once all are fetched (images from their headers), and refused together
        (:class:`MediaOverBudget`) before any is decoded when they surely expand past it:
        decoding is the expensive part, in time and memory.
        """
        labels = self._labels(items)
        first_index: dict[_Key, int] = {}
        for index, ref in enumerate(items):
            self._check_ref(index, ref, labels[index])
            first_index.setdefault((ref.kind, ref.url), index)
        sources, failure = await self._each(
            first_index, lambda index, key: self._source(index, key, labels)
        )
        if failure is not None:
            # An earlier item that only its decoding refuses is still the one to report.
            earlier = {key: i for key, i in first_index.items() if i < failure.index}
            _, decoded = await self._each(
                earlier, lambda i, key: self._decode(i, key, sources[key], labels)
            )
            raise decoded or failure
        if token_budget is not None:
            await self._check_budget(items, first_index, sources, token_budget, labels)
        loaded, failure = await self._each(
            first_index, lambda index, key: self._decode(index, key, sources[key], labels)
        )
        if failure is not None:
            raise failure
        return tuple(
            self._media_input(index, ref, loaded[(ref.kind, ref.url)], labels[index])
            for index, ref in enumerate(items)
        )

    def _labels(self, items: Sequence[MediaRef]) -> list[str]:
        """Each item's name in errors ("audio 1": its place among the items of its kind), the
        number of each kind checked against its limit."""
        seen: dict[MediaKind, int] = {"image": 0, "audio": 0, "video": 0}
        labels: list[str] = []
        for ref in items:
            labels.append(f"{ref.kind} {seen[ref.kind]}")
            seen[ref.kind] += 1
        for kind, count in seen.items():
            limit = self._most[kind]
            if count > limit:
                noun = "images" if kind == "image" else f"{kind} clips"
                raise MediaError(
                    limit,
                    f"too many {noun}: the request has {count}, at most {limit} allowed",
                    label=f"{kind} {limit}",
                )
        return labels

    async def _each(
        self,
        first_index: dict[_Key, int],
        work: Callable[[int, _Key], Awaitable[_T]],
    ) -> tuple[dict[_Key, _T], MediaError | None]:
        """``work`` for every distinct item concurrently: the results by key, and the
        lowest-index refusal (then the results hold every item before it).

        After a refusal, work on later items is cancelled at once, while earlier ones run on
        because one of them may fail too: the error a client sees does not depend on timing.
        """
        tasks = {
            asyncio.ensure_future(work(index, key)): index for key, index in first_index.items()
        }
        try:
            pending = set(tasks)
            first: MediaError | None = None
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    failure = task.exception()
                    if failure is None:
                        continue
                    if not isinstance(failure, MediaError):
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
            results = {key: by_index[i] for key, i in first_index.items() if i in by_index}
            return results, first
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _check_budget(
        self,
        items: Sequence[MediaRef],
        first_index: dict[_Key, int],
        sources: dict[_Key, bytes | str],
        budget: int,
        labels: list[str],
    ) -> None:
        """Refuse when the items' fewest possible tokens pass ``budget``: a count learnt for
        the client's uuid, else for an image the formula (or a count learnt for that size) at
        the header's size in either orientation (EXIF may turn it), else one token (the
        placeholder) for an item nothing is known about."""
        images = {key: i for key, i in first_index.items() if key[0] == "image"}

        async def size(index: int, key: _Key) -> tuple[int, int] | None:
            source = sources[key]
            if isinstance(source, str):
                return None
            try:
                return await self.decoder.size(source)
            except MediaRefused as refusal:
                raise refusal.at(index, labels[index]) from None

        sizes, failure = await self._each(images, size)
        if failure is not None:
            raise failure
        total = 0
        for index, ref in enumerate(items):
            learned = self.learned.get(ref.uuid) if ref.uuid else None
            dimensions = sizes.get((ref.kind, ref.url))
            if learned is not None:
                total += learned
            elif dimensions is not None and self._formula is not None:
                width, height = dimensions
                try:
                    total += min(
                        self._formula.tokens(width, height), self._formula.tokens(height, width)
                    )
                except MediaRefused as refusal:
                    raise refusal.at(index, labels[index]) from None
            elif dimensions is not None:
                # Without a formula, a count learnt for an image of this size (EXIF may turn
                # it, so only when both orientations are known).
                width, height = dimensions
                upright = self.learned.for_shape(image_shape(width, height))
                turned = self.learned.for_shape(image_shape(height, width))
                total += min(upright, turned) if upright and turned else 1
            else:
                total += 1
        if total > budget:
            raise MediaOverBudget(total, budget)

    async def _source(self, index: int, key: _Key, labels: list[str]) -> bytes | str:
        """The item's bytes, or the URL itself when vLLM is to fetch it (pass-through)."""
        kind, url = key
        limit = self._max_bytes[kind]
        try:
            if url[:5].lower() == "data:":
                return await self.decoder.data_uri_bytes(url, limit, kind)
            if self.config.mode == "passthrough":
                parse_url(url)
                return url
            return await self.fetcher.fetch(url, limit)
        except MediaRefused as refusal:
            raise refusal.at(index, labels[index]) from None

    async def _decode(
        self, index: int, key: _Key, source: bytes | str, labels: list[str]
    ) -> _Loaded:
        if isinstance(source, str):
            return source
        kind = key[0]
        try:
            if kind == "image":
                return await self.decoder.decode(source)
            return await self.clips.probe(kind, source)
        except MediaRefused as refusal:
            raise refusal.at(index, labels[index]) from None

    def observe(
        self,
        media: Sequence[MediaInput],
        prompt_len: int,
        expanded_prompt_tokens: int,
        expanded_ids: Sequence[int] | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        """Learn token counts from vLLM's first answer: per item from the expanded ids
        (``Delta.prompt_token_ids``) when present, as runs of the placeholder or, aligned
        with the prompt as sent (``prompt_ids``), as exact expansions; else from
        ``Delta.prompt_tokens``."""
        if expanded_ids and self.learned.observe_runs(media, prompt_len, expanded_ids):
            return
        if (
            expanded_ids
            and prompt_ids
            and self.learned.observe_expansions(media, prompt_ids, expanded_ids)
        ):
            return
        self.learned.observe(media, prompt_len, expanded_prompt_tokens)

    def _check_ref(self, index: int, ref: MediaRef, label: str) -> None:
        if ref.detail is not None and (ref.kind != "image" or ref.detail not in _DETAILS):
            raise MediaError(
                index, f"detail must be one of auto, low, high; got {ref.detail!r}", label=label
            )
        if ref.uuid is not None:
            if not ref.uuid or len(ref.uuid) > self.config.max_uuid_length:
                raise MediaError(
                    index,
                    f"uuid must be 1 to {self.config.max_uuid_length} characters",
                    label=label,
                )
            if not ref.uuid.isascii() or not ref.uuid.isprintable():
                raise MediaError(index, "uuid must be printable ASCII", label=label)
        scheme = ref.url[:8].lower()
        if not scheme.startswith(("data:", "http://", "https://")):
            raise MediaError(
                index, f"{ref.kind} url must be a data: URI or an http(s):// URL", label=label
            )

    def _media_input(self, index: int, ref: MediaRef, loaded: _Loaded, label: str) -> MediaInput:
        if isinstance(loaded, str):
            uuid = ref.uuid or url_identity(loaded)
            return MediaInput(
                uuid=uuid, url=loaded, num_tokens=self.learned.get(uuid), modality=ref.kind
            )
        uuid = ref.uuid or loaded.uuid
        if isinstance(loaded, ProbedClip):
            shape = loaded.shape
            self.learned.saw(uuid, shape)
            learned = self.learned.get(uuid)
            expansion = self.learned.expansion(uuid)
            if learned is None:
                learned = self.learned.for_shape(shape)
                expansion = self.learned.expansion_for_shape(shape)
            return MediaInput(
                uuid=uuid,
                mime_type=loaded.mime_type,
                data=loaded.data,
                num_tokens=learned,
                modality=ref.kind,
                expansion=expansion,
            )
        return MediaInput(
            uuid=uuid,
            mime_type=loaded.mime_type,
            data=loaded.data,
            num_tokens=self._count(index, uuid, loaded, label),
        )

    def _count(self, index: int, uuid: str, image: DecodedImage, label: str) -> int | None:
        learned = self.learned.get(uuid)
        shape = image_shape(image.width, image.height)
        self.learned.saw(uuid, shape)
        if learned is not None:
            return learned
        if self._formula is None:
            return self.learned.for_shape(shape)
        try:
            return self._formula.tokens(image.width, image.height)
        except MediaRefused as refusal:
            raise refusal.at(index, label) from None

    async def aclose(self) -> None:
        await self.fetcher.aclose()
        self.decoder.close()
        self.clips.close()
        self.decoders.close()
