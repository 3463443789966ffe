"""Media attached to a request: where their bytes come from, who they are, how big they get.

vLLM expands each placeholder in the prompt into as many tokens as the encoder produces for
that item. The mock derives each count from the content alone, which keeps it a pure function
of the bytes, as vLLM's processors are: an image's pixel size (one token per ``patch`` x
``patch`` tile, capped), an audio clip's duration (``audio_tokens_per_second``, capped), a
video's frames (up to ``video_frames`` sampled, two per temporal patch, each tiled like an
image). It identifies each item by the caller's ``uuid`` (the key vLLM uses for its caches)
or, when absent, by a SHA-256 of its bytes. A model without a modality's placeholder token
refuses that modality, as vLLM does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass

import av
import httpx
from PIL import Image, UnidentifiedImageError

from rankgate.mocker.status import invalid_argument
from rankgate.wire.proto.vllm import inference_pb2

_KINDS = {
    inference_pb2.MODALITY_UNSPECIFIED: "image",
    inference_pb2.MODALITY_IMAGE: "image",
    inference_pb2.MODALITY_AUDIO: "audio",
    inference_pb2.MODALITY_VIDEO: "video",
}


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """An expanded item inside the prompt: its identity and placeholder range."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """How the mock model takes media; a kind without a token id is refused."""

    image_token_id: int | None
    patch_size: int
    max_tokens: int
    max_bytes: int
    audio_token_id: int | None = None
    video_token_id: int | None = None
    audio_tokens_per_second: float = 12.5
    video_frames: int = 16

    def token_id(self, kind: str) -> int | None:
        if kind == "audio":
            return self.audio_token_id
        if kind == "video":
            return self.video_token_id
        return self.image_token_id

    def tokens_for(self, width: int, height: int) -> int:
        tiles = math.ceil(width / self.patch_size) * math.ceil(height / self.patch_size)
        return max(1, min(self.max_tokens, tiles))

    def audio_tokens(self, seconds: float) -> int:
        return max(1, min(self.max_tokens, math.ceil(seconds * self.audio_tokens_per_second)))

    def video_tokens(self, frames: int, width: int, height: int) -> int:
        sampled = min(frames, self.video_frames)
        per_frame = math.ceil(width / self.patch_size) * math.ceil(height / self.patch_size)
        return max(1, min(self.max_tokens, math.ceil(sampled / 2) * per_frame))


class MediaResolver:
    """Fetches and measures media; owns the one HTTP client used for ``url`` sources."""

    def __init__(self, policy: ImagePolicy | None) -> None:
        self.policy = policy
        self._client: httpx.AsyncClient | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def expand(
        self, prompt: list[int], media: list[inference_pb2.MediaItem], lora: str
    ) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """Replace each placeholder with its item's tokens: the n-th item of a kind takes the
        n-th placeholder of that kind."""
        policy = self.policy
        if policy is None:
            raise invalid_argument("this model does not support multimodal inputs")
        if any(item.WhichOneof("source") == "features" for item in media):
            return prompt, self._preprocessed(prompt, media, lora)
        placed: list[tuple[int, int, str]] = []
        for kind in ("image", "audio", "video"):
            members = [i for i, item in enumerate(media) if _KINDS.get(item.modality) == kind]
            if not members:
                continue
            token = policy.token_id(kind)
            if token is None:
                raise invalid_argument(f"this model does not support {kind} input")
            positions = [i for i, t in enumerate(prompt) if t == token]
            if len(positions) != len(members):
                raise invalid_argument(
                    f"the prompt has {len(positions)} {kind} placeholder token(s) "
                    f"(id {token}) but the request carries {len(members)} {kind} item(s)"
                )
            placed.extend((p, m, kind) for p, m in zip(positions, members, strict=True))
        unknown = [i for i, item in enumerate(media) if item.modality not in _KINDS]
        if unknown:
            raise invalid_argument(f"media[{unknown[0]}] has an unknown modality")
        expanded: list[int] = []
        spans: list[MediaSpan] = []
        cursor = 0
        for position, index, kind in sorted(placed):
            item = media[index]
            data = await self._bytes(index, item)
            # Decoding is the engine's preprocessing, off its event loop as in vLLM.
            count = await asyncio.to_thread(_count, policy, kind, index, data)
            expanded.extend(prompt[cursor:position])
            identifier = item.uuid or hashlib.sha256(data).hexdigest()
            if lora:
                identifier = f"{lora}:{identifier}"
            spans.append(MediaSpan(identifier, len(expanded), count))
            expanded.extend([prompt[position]] * count)
            cursor = position + 1
        expanded.extend(prompt[cursor:])
        return expanded, tuple(spans)

    def _preprocessed(
        self, prompt: list[int], media: list[inference_pb2.MediaItem], lora: str
    ) -> tuple[MediaSpan, ...]:
        spans: list[MediaSpan] = []
        for index, item in enumerate(media):
            if item.WhichOneof("source") != "features":
                raise invalid_argument(
                    "media items must all be preprocessed features or all be raw sources"
                )
            features = item.features
            if features.offset + features.length > len(prompt):
                raise invalid_argument(
                    f"media[{index}].features placeholder range exceeds token_ids"
                )
            identifier = features.identifier or item.uuid
            if lora:
                identifier = f"{lora}:{identifier}"
            spans.append(MediaSpan(identifier, features.offset, features.length))
        return tuple(spans)

    async def _bytes(self, index: int, item: inference_pb2.MediaItem) -> bytes:
        assert self.policy is not None
        source = item.WhichOneof("source")
        if source == "raw_bytes":
            data = item.raw_bytes
        elif source == "data_uri":
            data = _decode_data_uri(index, item.data_uri)
        elif source == "url":
            data = await self._fetch(index, item.url)
        else:
            raise invalid_argument(f"media[{index}] has no source")
        if len(data) > self.policy.max_bytes:
            raise invalid_argument(
                f"media[{index}] is {len(data)} bytes; the limit is {self.policy.max_bytes}"
            )
        return data

    async def _fetch(self, index: int, url: str) -> bytes:
        if url.startswith("data:"):
            return _decode_data_uri(index, url)
        if not url.startswith(("http://", "https://")):
            raise invalid_argument(f"media[{index}].url must be http(s) or data: (got {url!r})")
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=10.0, follow_redirects=True)
        assert self.policy is not None
        try:
            async with self._client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise invalid_argument(
                        f"media[{index}]: fetching {url} returned HTTP {response.status_code}"
                    )
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.policy.max_bytes:
                        raise invalid_argument(f"media[{index}]: {url} exceeds the size limit")
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.HTTPError as exc:
            raise invalid_argument(f"media[{index}]: fetching {url} failed: {exc}") from exc


def _decode_data_uri(index: int, uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not header.startswith("data:") or not sep:
        raise invalid_argument(f"media[{index}].data_uri is not a data: URI")
    try:
        if header.endswith(";base64"):
            return base64.b64decode(payload, validate=True)
        return payload.encode()
    except binascii.Error as exc:
        raise invalid_argument(f"media[{index}].data_uri has invalid base64: {exc}") from exc


def _image_size(index: int, data: bytes) -> tuple[int, int]:
    """Reads only the header: Pillow opens lazily, so this costs microseconds, not a decode."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise invalid_argument(f"media[{index}] is not a decodable image: {exc}") from exc
    if width < 1 or height < 1:
        raise invalid_argument(f"media[{index}] has an empty image")
    return width, height


def _count(policy: ImagePolicy, kind: str, index: int, data: bytes) -> int:
    if kind == "image":
        width, height = _image_size(index, data)
        return policy.tokens_for(width, height)
    try:
        with av.open(io.BytesIO(data), mode="r") as opened:
            if kind == "audio":
                if not opened.streams.audio:
                    raise invalid_argument(f"media[{index}] has no audio stream")
                stream = opened.streams.audio[0]
                samples = sum(frame.samples for frame in opened.decode(stream))
                rate = stream.codec_context.sample_rate or 1
                return policy.audio_tokens(samples / rate)
            if not opened.streams.video:
                raise invalid_argument(f"media[{index}] has no video stream")
            video = opened.streams.video[0]
            frames = sum(1 for packet in opened.demux(video) if packet.size)
            return policy.video_tokens(
                frames, video.codec_context.width, video.codec_context.height
            )
    except (av.FFmpegError, ValueError) as exc:
        raise invalid_argument(f"media[{index}] is not a decodable {kind}: {exc}") from exc
