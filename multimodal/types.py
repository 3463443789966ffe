"""The package's inputs: one image reference per OpenAI image part, and every limit in one place."""

from __future__ import annotations

import ipaddress
from typing import Literal

import msgspec

MediaMode = Literal["fetch", "passthrough"]
TokenFamily = Literal["auto", "qwen2_vl", "llava_1_5", "none"]
ImageDetail = Literal["auto", "low", "high"]

_KNOWN_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "JPEG2000"})


class ImageRef(msgspec.Struct, frozen=True):
    """An ``image_url`` content part as the client sent it.

    ``url`` is a ``data:`` URI or an ``http(s)://`` URL; ``uuid`` is the client's own identity
    for the image (OpenAI ``uuid`` / vLLM ``multi_modal_uuids``), used instead of the content
    hash when given.
    """

    url: str
    uuid: str | None = None
    detail: str | None = None


class MediaConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Every limit and knob of image handling; validated once at construction.

    ``mode`` "fetch" downloads and decodes every image and sends vLLM its bytes (vLLM never
    fetches); "passthrough" forwards ``http(s)`` URLs for vLLM to fetch and identifies them by
    a hash of the URL text, which is weaker: one picture at two URLs gets two identities, and
    a URL whose content changes keeps its identity.
    """

    mode: MediaMode = "fetch"
    max_images: int = 16
    max_image_bytes: int = 20 << 20
    max_pixels: int = 7680 * 4320
    allowed_formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF")
    connect_timeout: float = 5.0
    read_timeout: float = 10.0
    total_timeout: float = 30.0
    max_redirects: int = 3
    max_connections: int = 64
    # CIDR networks that may be fetched even though they are loopback, private or link-local.
    allowed_networks: tuple[str, ...] = ()
    fetch_cache_bytes: int = 256 << 20
    decode_workers: int = 2
    decode_memo_bytes: int = 64 << 20
    learned_token_entries: int = 65536
    token_family: TokenFamily = "auto"
    qwen_patch_size: int = 14
    qwen_merge_size: int = 2
    # Qwen2-VL / Qwen2.5-VL preprocessor_config.json defaults.
    qwen_min_pixels: int = 56 * 56
    qwen_max_pixels: int = 28 * 28 * 16384
    fixed_image_tokens: int = 576
    max_uuid_length: int = 256
    user_agent: str = "rankgate-image-fetcher/1"

    def __post_init__(self) -> None:
        positive = {
            "max_images": self.max_images,
            "max_image_bytes": self.max_image_bytes,
            "max_pixels": self.max_pixels,
            "max_connections": self.max_connections,
            "decode_workers": self.decode_workers,
            "learned_token_entries": self.learned_token_entries,
            "qwen_patch_size": self.qwen_patch_size,
            "qwen_merge_size": self.qwen_merge_size,
            "qwen_min_pixels": self.qwen_min_pixels,
            "fixed_image_tokens": self.fixed_image_tokens,
            "max_uuid_length": self.max_uuid_length,
            "connect_timeout": self.connect_timeout,
            "read_timeout": self.read_timeout,
            "total_timeout": self.total_timeout,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_redirects < 0 or self.fetch_cache_bytes < 0 or self.decode_memo_bytes < 0:
            raise ValueError("max_redirects and cache sizes must be >= 0")
        if self.qwen_max_pixels < self.qwen_min_pixels:
            raise ValueError("qwen_max_pixels must be >= qwen_min_pixels")
        if not self.allowed_formats:
            raise ValueError("allowed_formats must name at least one format")
        unknown = [f for f in self.allowed_formats if f not in _KNOWN_FORMATS]
        if unknown:
            raise ValueError(f"unknown image formats {unknown}; known: {sorted(_KNOWN_FORMATS)}")
        for network in self.allowed_networks:
            ipaddress.ip_network(network, strict=False)
