"""How many prompt tokens each image or clip becomes inside vLLM, for routing on its blocks.

The prompt carries one placeholder token per item and vLLM expands it; the router must know
the expanded length to hash the same blocks vLLM reports. For image model families with a known
rule it is computed from the image size (:class:`QwenVLPatchMerge`, :class:`FixedTokens`);
otherwise, and for every audio and video clip, it is learned from the first request that
carries the item, from vLLM's expanded prompt (:class:`LearnedTokenCounts`), and stands for
any later item of the same shape. When neither knows, the count is None and the router routes
on the text before the first such item.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.lru import BoundedLRU
from rankgate.multimodal.types import MediaConfig
from rankgate.sidecar.routing.hashing import image_runs
from rankgate.sidecar.types import MediaInput

_QWEN_MAX_ASPECT = 200


class ImageTokenFormula(Protocol):
    @property
    def name(self) -> str: ...

    def tokens(self, width: int, height: int) -> int:
        """Expanded token count of a ``width`` x ``height`` image (after EXIF orientation)."""
        ...


class QwenVLPatchMerge:
    """Qwen2-VL / Qwen2.5-VL: resize to multiples of ``patch * merge`` within a pixel budget.

    Each side is rounded to the nearest multiple of the factor; if the area then leaves
    ``[min_pixels, max_pixels]``, both sides are scaled by the square root of the area ratio
    and floored (too big) or ceiled (too small) to the factor. One token per merged patch.
    """

    name = "qwen2_vl"

    def __init__(self, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int):
        self._patch = patch_size
        self._merge = merge_size
        self._factor = patch_size * merge_size
        self._min_pixels = min_pixels
        self._max_pixels = max_pixels

    def resized(self, width: int, height: int) -> tuple[int, int]:
        if max(width, height) / min(width, height) > _QWEN_MAX_ASPECT:
            raise MediaRefused(
                f"aspect ratio of {width}x{height} is over {_QWEN_MAX_ASPECT}, "
                "which Qwen2-VL models refuse"
            )
        f = self._factor
        h_bar = round(height / f) * f
        w_bar = round(width / f) * f
        if h_bar * w_bar > self._max_pixels:
            beta = math.sqrt(height * width / self._max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self._min_pixels:
            beta = math.sqrt(self._min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return w_bar, h_bar

    def tokens(self, width: int, height: int) -> int:
        w_bar, h_bar = self.resized(width, height)
        return (w_bar // self._patch) * (h_bar // self._patch) // (self._merge * self._merge)


class FixedTokens:
    """Families that resize every image to one shape, e.g. LLaVA-1.5: (336/14)^2 = 576."""

    name = "fixed"

    def __init__(self, count: int) -> None:
        self._count = count

    def tokens(self, width: int, height: int) -> int:
        return self._count


_QWEN_MARKERS = ("qwen2-vl", "qwen2_vl", "qwen2.5-vl", "qwen2_5_vl", "qwen2.5_vl", "qwen2_5-vl")
_LLAVA_15_MARKERS = ("llava-1.5", "llava-v1.5", "llava_1.5", "llava-1_5", "llava_v1.5")


def formula_for(config: MediaConfig, model_id: str) -> ImageTokenFormula | None:
    """The formula ``config.token_family`` selects; "auto" matches the model id's family."""
    family = config.token_family
    if family == "auto":
        lowered = model_id.lower()
        if any(marker in lowered for marker in _QWEN_MARKERS):
            family = "qwen2_vl"
        elif any(marker in lowered for marker in _LLAVA_15_MARKERS):
            family = "llava_1_5"
        else:
            return None
    if family == "qwen2_vl":
        return QwenVLPatchMerge(
            config.qwen_patch_size,
            config.qwen_merge_size,
            config.qwen_min_pixels,
            config.qwen_max_pixels,
        )
    if family == "llava_1_5":
        return FixedTokens(config.fixed_image_tokens)
    return None


Shape = tuple[int, ...]


def image_shape(width: int, height: int) -> Shape:
    """The shape key of an image (clips have theirs:
    :attr:`rankgate.multimodal.clips.ProbedClip.shape`)."""
    return (1, width, height)


class LearnedTokenCounts:
    """Expanded token counts observed from vLLM, by item uuid and by item shape, LRU-bounded.

    What vLLM reports is the truth, so an observation overrides a formula's count. vLLM's
    processors derive an item's token count from its shape alone (an image's size; a clip's
    sample count, or its frame size, count and span), so a count learnt for one item also
    stands for a new item of the same shape (:meth:`for_shape`).
    """

    def __init__(self, capacity: int, expansion_bytes: int = 16 << 20) -> None:
        self._counts: BoundedLRU[str, int] = BoundedLRU(capacity)
        self._shapes: BoundedLRU[str, Shape] = BoundedLRU(capacity)
        self._by_shape: BoundedLRU[Shape, int] = BoundedLRU(capacity)
        # Expansions that are not one run of the placeholder, charged at a tuple's size.
        self._expansions: BoundedLRU[str, tuple[int, ...]] = BoundedLRU(
            expansion_bytes // 2, cost=_tuple_bytes
        )
        self._expansion_by_shape: BoundedLRU[Shape, tuple[int, ...]] = BoundedLRU(
            expansion_bytes // 2, cost=_tuple_bytes
        )

    def expansion(self, uuid: str) -> tuple[int, ...] | None:
        return self._expansions.get(uuid)

    def expansion_for_shape(self, shape: Shape) -> tuple[int, ...] | None:
        return self._expansion_by_shape.get(shape)

    def observe_expansions(
        self, media: Sequence[MediaInput], prompt: Sequence[int], expanded: Sequence[int]
    ) -> list[str]:
        """Learn each item's exact expansion from vLLM's expanded prompt, where it is not a run
        of the placeholder: the text around each placeholder is the same in both prompts, so
        what lies between is the item's. Returns the uuids learnt (none when the prompts do
        not line up, e.g. two placeholders with nothing between them)."""
        positions = [item.position for item in media]
        if not media or any(p is None for p in positions):
            return []
        spans = _expansion_spans([p for p in positions if p is not None], prompt, expanded)
        if spans is None:
            return []
        learned: list[str] = []
        for item, (start, end) in zip(media, spans, strict=True):
            tokens = tuple(expanded[start:end])
            if not tokens:
                return learned
            self._learn(item.uuid, len(tokens))
            self._expansions.put(item.uuid, tokens)
            shape = self._shapes.get(item.uuid)
            if shape is not None:
                self._expansion_by_shape.put(shape, tokens)
            learned.append(item.uuid)
        return learned

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, uuid: str) -> int | None:
        return self._counts.get(uuid)

    def for_shape(self, shape: Shape) -> int | None:
        return self._by_shape.get(shape)

    def saw(self, uuid: str, shape: Shape) -> None:
        """Remember a prepared item's shape, so that its count, once learnt, covers its shape."""
        self._shapes.put(uuid, shape)

    def _learn(self, uuid: str, count: int) -> None:
        self._counts.put(uuid, count)
        shape = self._shapes.get(uuid)
        if shape is not None:
            self._by_shape.put(shape, count)

    def observe_runs(
        self, media: Sequence[MediaInput], prompt_len: int, expanded: Sequence[int]
    ) -> list[str]:
        """Learn every image of one request from vLLM's expanded prompt (``PromptInfo``'s
        token ids): each placeholder's run is that image's count, however many are new."""
        positions = [item.position for item in media]
        if any(position is None for position in positions):
            return []
        groups = image_runs([p for p in positions if p is not None], prompt_len, expanded)
        if groups is None:
            return []
        learned: list[str] = []
        for members, total in groups:
            found = self._split([media[i] for i in members], total)
            for uuid, count in found.items():
                self._learn(uuid, count)
                learned.append(uuid)
        return learned

    def _split(self, run: Sequence[MediaInput], total: int) -> dict[str, int]:
        """Each image's share of a run of adjacent placeholders that expanded to ``total``:
        what the known counts leave to one unknown image, or an even split among unknown
        items of one shape (a count depends on the shape alone)."""
        unknown: list[MediaInput] = []
        for item in run:
            count = self.get(item.uuid)
            count = count if count is not None else item.num_tokens
            if count is None:
                unknown.append(item)
            else:
                total -= count
        if not unknown:
            return {}
        uuids = {item.uuid for item in unknown}
        shapes = {self._shapes.get(uuid) for uuid in uuids}
        if len(uuids) > 1 and (len(shapes) != 1 or None in shapes):
            return {}
        count, remainder = divmod(total, len(unknown))
        if remainder or count <= 0:
            return {}
        return dict.fromkeys(uuids, count)

    def observe(
        self,
        media: Sequence[MediaInput],
        prompt_len: int,
        expanded_prompt_tokens: int,
    ) -> str | None:
        """Learn from one request; returns the uuid learnt, if any.

        ``prompt_len`` counts the prompt as sent (one placeholder per image) and
        ``expanded_prompt_tokens`` is vLLM's count after expansion, so the images together
        expand to ``expanded - prompt_len + len(media)`` tokens. That pins down one count when
        only one distinct image is unaccounted for; otherwise nothing is learnt.
        """
        if not media:
            return None
        image_total = expanded_prompt_tokens - prompt_len + len(media)
        distinct = {item.uuid for item in media}
        if len(distinct) == 1:
            unknown = next(iter(distinct))
        else:
            known: dict[str, int] = {}
            for item in media:
                count = self.get(item.uuid)
                count = count if count is not None else item.num_tokens
                if count is not None:
                    known[item.uuid] = count
            missing = distinct - known.keys()
            if len(missing) != 1:
                return None
            unknown = next(iter(missing))
            image_total -= sum(known[item.uuid] for item in media if item.uuid in known)
        repeats = sum(1 for item in media if item.uuid == unknown)
        count, remainder = divmod(image_total, repeats)
        if remainder or count <= 0:
            return None
        self._learn(unknown, count)
        return unknown


def _tuple_bytes(tokens: tuple[int, ...]) -> int:
    # A tuple's header and pointers, and an int object per token (small ones are shared).
    return 56 + 8 * len(tokens) + 32 * len(tokens)


def _expansion_spans(
    positions: Sequence[int], prompt: Sequence[int], expanded: Sequence[int]
) -> list[tuple[int, int]] | None:
    """Where each placeholder's expansion lies in ``expanded``: ``[(start, end)]``, or None.

    The text after each placeholder (up to the next one, or the prompt's end) must follow its
    expansion in ``expanded``; the last item's is fixed by the prompt's tail, the others' by
    the first place their following text appears, checked by the whole alignment adding up.
    """
    spans: list[tuple[int, int]] = []
    shift = 0
    for index, position in enumerate(positions):
        if index and position <= positions[index - 1]:
            return None
        start = position + shift
        if start > len(expanded):
            return None
        following = positions[index + 1] if index + 1 < len(positions) else len(prompt)
        text = list(prompt[position + 1 : following])
        if index + 1 == len(positions):
            end = len(expanded) - len(text)
            if end < start or list(expanded[end:]) != text:
                return None
        else:
            found = _find(expanded, text, start) if text else None
            if found is None:
                return None
            end = found
        spans.append((start, end))
        shift += end - start - 1
    if list(expanded[: positions[0]]) != list(prompt[: positions[0]]):
        return None
    return spans


def _find(haystack: Sequence[int], needle: list[int], start: int) -> int | None:
    first = needle[0]
    for index in range(start, len(haystack) - len(needle) + 1):
        if haystack[index] == first and list(haystack[index : index + len(needle)]) == needle:
            return index
    return None
