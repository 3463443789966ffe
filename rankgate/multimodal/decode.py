"""Image validation and decoding with Pillow, always in a decoder process.

Pillow parses hostile bytes in C, so it runs in the gateway's decoder processes
(:mod:`rankgate.multimodal.isolation`), header reads included; the gateway keeps the memo of
what they found, and a few threads that hash, recall and wait on them while the event loop
only awaits. Every refusal is an :class:`MediaRefused` with
a reason a client can act on: format not allowed, too many pixels (decompression bombs are
refused from the header, before any pixel is decoded), truncated or corrupt data. The header
alone (:func:`image_size`) is enough to check a request's images against its token budget
before any of them is decoded.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import msgspec
from PIL import Image, ImageOps, UnidentifiedImageError

from rankgate.multimodal.datauri import parse_data_uri
from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.identity import canonical_rgb, content_identity
from rankgate.multimodal.isolation import DecoderPool
from rankgate.multimodal.lru import BoundedLRU

_EXIF_ORIENTATION = 0x0112
# Magic numbers of formats Pillow may know, only to name a refused format in the message.
_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", 0, "PNG"),
    (b"\xff\xd8\xff", 0, "JPEG"),
    (b"GIF87a", 0, "GIF"),
    (b"GIF89a", 0, "GIF"),
    (b"WEBP", 8, "WEBP"),
    (b"BM", 0, "BMP"),
    (b"II*\x00", 0, "TIFF"),
    (b"MM\x00*", 0, "TIFF"),
    (b"ftypavif", 4, "AVIF"),
    (b"ftypheic", 4, "HEIC"),
    (b"\x00\x00\x00\x0cjP  ", 0, "JPEG2000"),
    (b"\xff\x4f\xff\x51", 0, "JPEG2000"),
    (b"8BPS", 0, "PSD"),
    (b"\x00\x00\x01\x00", 0, "ICO"),
    (b"%!PS", 0, "EPS"),
    (b"<svg", 0, "SVG"),
    (b"<?xml", 0, "SVG"),
)


class DecodeLimits(msgspec.Struct, frozen=True):
    allowed_formats: tuple[str, ...]
    max_pixels: int


class DecodedImage(msgspec.Struct, frozen=True):
    """A validated image: its identity, its size after EXIF orientation, and what to send.

    ``data`` is the transport bytes unchanged, or a lossless PNG of the canonical pixels when
    EXIF orientation had to be applied. The identity describes the upright pixels, so those
    are what the engine gets, with no EXIF left to apply: vLLM 0.32's image loader turns an
    image by its EXIF too (``normalize_image``), but what the engine sees then does not hang
    on which of its paths decodes the bytes.
    """

    uuid: str
    width: int
    height: int
    mime_type: str
    data: bytes


_Side = Annotated[int, msgspec.Meta(ge=1)]
_Size = tuple[_Side, _Side]


class _HeaderSize(msgspec.Struct, frozen=True, array_like=True):
    """:func:`image_size` as a decoder process answers it: ``[width, height]``."""

    width: _Side
    height: _Side


class ImageFacts(msgspec.Struct, frozen=True):
    """What a decoder process found in an image, without the bytes the gateway already has:
    ``reencoded`` is the upright PNG when EXIF orientation was applied, and ``header`` the
    size the header states, before orientation."""

    uuid: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    width: _Side
    height: _Side
    mime_type: str
    reencoded: bytes | None
    header: _Size


def sniff_format(data: bytes) -> str | None:
    for magic, offset, name in _MAGIC:
        if data[offset : offset + len(magic)] == magic:
            return name
    return None


def image_size(data: bytes, limits: DecodeLimits) -> tuple[int, int]:
    """Width and height as the header states them, before EXIF orientation; no pixel is
    decoded. Refuses what :func:`decode_image` would refuse from the header alone."""
    with _open(data, limits) as image:
        return image.size


def _open(data: bytes, limits: DecodeLimits) -> Image.Image:
    """The image with only its header read, its format and pixel count checked."""
    if not data:
        raise MediaRefused("empty image data")
    allowed = ", ".join(limits.allowed_formats)
    try:
        image = Image.open(io.BytesIO(data), formats=list(limits.allowed_formats))
    except UnidentifiedImageError:
        sniffed = sniff_format(data)
        if sniffed is not None and sniffed not in limits.allowed_formats:
            raise MediaRefused(f"format {sniffed} is not allowed (allowed: {allowed})") from None
        if sniffed is not None:
            raise MediaRefused(f"corrupt {sniffed} header: Pillow cannot read it") from None
        raise MediaRefused(f"corrupt or unrecognised image data (allowed: {allowed})") from None
    except Image.DecompressionBombError as exc:
        raise MediaRefused(f"decompression bomb refused: {exc}") from None
    except MemoryError:
        raise
    except Exception as exc:  # Pillow's parsers raise many types on hostile headers.
        raise MediaRefused(f"corrupt {sniff_format(data) or 'image'} header: {exc}") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        image.close()
        raise MediaRefused(f"invalid image size {width}x{height}")
    if width * height > limits.max_pixels:
        image.close()
        raise MediaRefused(
            f"{width}x{height} is {width * height} pixels, over the limit of "
            f"{limits.max_pixels} (decompression bomb guard)"
        )
    return image


def decode_image(data: bytes, limits: DecodeLimits) -> DecodedImage:
    """Validate and decode ``data``; blocking, and in the gateway meant for a decoder process.

    Running out of memory is not a refusal: the decoder process reports it as such."""
    return _decode(data, limits)[0]


def image_facts(data: bytes, limits: DecodeLimits) -> ImageFacts:
    """:func:`decode_image`'s findings, as a decoder process answers them."""
    decoded, header = _decode(data, limits)
    reencoded = decoded.data if decoded.data is not data else None
    return ImageFacts(
        decoded.uuid, decoded.width, decoded.height, decoded.mime_type, reencoded, header
    )


def _decode(data: bytes, limits: DecodeLimits) -> tuple[DecodedImage, tuple[int, int]]:
    with _open(data, limits) as image:
        width, height = image.size
        fmt = image.format or "unknown"
        try:
            image.load()
            orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
            upright = ImageOps.exif_transpose(image) if orientation != 1 else image
        except MemoryError:
            raise
        except Exception as exc:
            text = str(exc)
            if "truncated" in text or isinstance(exc, EOFError):
                raise MediaRefused(f"truncated {fmt} data: {text or 'unexpected end'}") from None
            raise MediaRefused(f"corrupt {fmt} data: {text}") from None
        if upright is image:
            return DecodedImage(
                uuid=content_identity(data),
                width=width,
                height=height,
                mime_type=Image.MIME.get(fmt, "application/octet-stream"),
                data=data,
            ), (width, height)
        rgb = canonical_rgb(upright)
        buffer = io.BytesIO()
        rgb.save(buffer, format="PNG", compress_level=1)
        turned = buffer.getvalue()
        return DecodedImage(
            uuid=content_identity(turned),
            width=rgb.width,
            height=rgb.height,
            mime_type="image/png",
            data=turned,
        ), (width, height)


class ImageDecoder:
    """Runs :func:`decode_image` and :func:`image_size` in ``pool``'s decoder processes and
    remembers recent results.

    The memo is keyed by a digest of the transport bytes, so a chat that resends the same
    images on every turn pays one hash per image instead of a decode, and its header size
    is recalled too. Threads hash, recall and wait on the decoders; at most ``workers * 2``
    jobs are handed to them at once, the rest wait on the event loop, and the pool refuses
    jobs past its queue.
    """

    def __init__(self, limits: DecodeLimits, pool: DecoderPool, memo_bytes: int) -> None:
        self._params = msgspec.msgpack.encode(limits)
        self._pool = pool
        workers = pool.limits.workers
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rankgate-image")
        self._slots = asyncio.Semaphore(workers * 2)
        self._memo: BoundedLRU[bytes, ImageFacts] = BoundedLRU(
            memo_bytes, cost=lambda r: 256 + (len(r.reencoded) if r.reencoded else 0)
        )
        self._memo_lock = threading.Lock()
        self.decoded = 0
        self.recalled = 0

    async def decode(self, data: bytes) -> DecodedImage:
        with self._pool.admitted():
            async with self._slots:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._threads, self._decode_or_recall, data)

    async def data_uri_bytes(self, uri: str, max_bytes: int, kind: str = "image") -> bytes:
        """The payload of a ``data:`` URI of ``kind``, base64-decoded on a thread."""
        async with self._slots:
            loop = asyncio.get_running_loop()
            _, data = await loop.run_in_executor(
                self._threads, parse_data_uri, uri, max_bytes, kind
            )
            return data

    async def size(self, data: bytes) -> tuple[int, int]:
        """:func:`image_size`, or the memo's: what a budget can be checked against before any
        pixel is decoded."""
        with self._pool.admitted():
            async with self._slots:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._threads, self._size_or_recall, data)

    def _recall(self, key: bytes) -> ImageFacts | None:
        with self._memo_lock:
            return self._memo.get(key)

    def _size_or_recall(self, data: bytes) -> tuple[int, int]:
        hit = self._recall(hashlib.sha256(data).digest())
        if hit is not None:
            return hit.header
        size = self._pool.run("image_size", self._params, data, _HeaderSize)
        return size.width, size.height

    def _decode_or_recall(self, data: bytes) -> DecodedImage:
        key = hashlib.sha256(data).digest()
        facts = self._recall(key)
        if facts is not None:
            with self._memo_lock:
                self.recalled += 1
        else:
            facts = self._pool.run("image", self._params, data, ImageFacts)
            with self._memo_lock:
                self.decoded += 1
                self._memo.put(key, facts)
        return DecodedImage(
            uuid=facts.uuid,
            width=facts.width,
            height=facts.height,
            mime_type=facts.mime_type,
            data=facts.reencoded if facts.reencoded is not None else data,
        )

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
