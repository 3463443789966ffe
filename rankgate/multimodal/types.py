"""The package's inputs: one reference per OpenAI media part, and every limit in one place."""

from __future__ import annotations

import ipaddress
from typing import Literal

import msgspec

MediaMode = Literal["fetch", "passthrough"]
MediaKind = Literal["image", "audio", "video"]
TokenFamily = Literal["auto", "qwen2_vl", "llava_1_5", "none"]
ImageDetail = Literal["auto", "low", "high"]

_KNOWN_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "JPEG2000"})
# Containers the gateway can tell by their first bytes (see :mod:`rankgate.multimodal.clips`).
KNOWN_AUDIO_CONTAINERS = frozenset({"wav", "flac", "mp3", "ogg", "webm", "mp4"})
KNOWN_VIDEO_CONTAINERS = frozenset({"mp4", "webm", "avi"})
# A decoder process's address space with Pillow and FFmpeg loaded is about 170 MiB.
MIN_DECODE_MEMORY = 256 << 20


class MediaRef(msgspec.Struct, frozen=True):
    """An ``image_url``, ``input_audio``, ``audio_url`` or ``video_url`` part as sent.

    ``url`` is a ``data:`` URI or an ``http(s)://`` URL (``input_audio`` data arrives as a
    ``data:`` URI); ``uuid`` is the client's own identity for the item (vLLM's per-part
    ``uuid``), used instead of the content hash when given.
    """

    url: str
    uuid: str | None = None
    detail: str | None = None
    kind: MediaKind = "image"


class MediaConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Every limit and knob of media handling; validated once at construction.

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
    # Decoder processes (rankgate.multimodal.isolation): how many, how many jobs may wait for
    # one, and what one job may use of wall time, CPU time and address space.
    decode_workers: int = 2
    decode_queue: int = 64
    decode_timeout: float = 20.0
    decode_cpu_seconds: int = 10
    decode_memory_bytes: int = 1 << 30
    decode_memo_bytes: int = 64 << 20
    learned_token_entries: int = 65536
    token_family: TokenFamily = "auto"
    qwen_patch_size: int = 14
    qwen_merge_size: int = 2
    # Qwen2-VL / Qwen2.5-VL preprocessor_config.json defaults.
    qwen_min_pixels: int = 56 * 56
    qwen_max_pixels: int = 28 * 28 * 16384
    fixed_image_tokens: int = 576
    # Audio and video: vLLM 0.32's own defaults where it has them (VLLM_MAX_AUDIO_*).
    max_audios: int = 8
    max_audio_bytes: int = 25 << 20
    max_audio_seconds: float = 600.0
    max_audio_decoded_bytes: int = 256 << 20
    allowed_audio_containers: tuple[str, ...] = ("wav", "flac", "mp3", "ogg", "webm", "mp4")
    max_videos: int = 4
    max_video_bytes: int = 64 << 20
    max_video_seconds: float = 600.0
    max_video_frames: int = 36_000
    max_video_frame_pixels: int = 3840 * 2160
    allowed_video_containers: tuple[str, ...] = ("mp4", "webm")
    max_uuid_length: int = 256
    user_agent: str = "rankgate-image-fetcher/1"

    def __post_init__(self) -> None:
        positive = {
            "max_images": self.max_images,
            "max_image_bytes": self.max_image_bytes,
            "max_pixels": self.max_pixels,
            "max_connections": self.max_connections,
            "decode_workers": self.decode_workers,
            "decode_timeout": self.decode_timeout,
            "decode_cpu_seconds": self.decode_cpu_seconds,
            "decode_memory_bytes": self.decode_memory_bytes,
            "learned_token_entries": self.learned_token_entries,
            "qwen_patch_size": self.qwen_patch_size,
            "qwen_merge_size": self.qwen_merge_size,
            "qwen_min_pixels": self.qwen_min_pixels,
            "fixed_image_tokens": self.fixed_image_tokens,
            "max_uuid_length": self.max_uuid_length,
            "max_audios": self.max_audios,
            "max_audio_bytes": self.max_audio_bytes,
            "max_audio_seconds": self.max_audio_seconds,
            "max_audio_decoded_bytes": self.max_audio_decoded_bytes,
            "max_videos": self.max_videos,
            "max_video_bytes": self.max_video_bytes,
            "max_video_seconds": self.max_video_seconds,
            "max_video_frames": self.max_video_frames,
            "max_video_frame_pixels": self.max_video_frame_pixels,
            "connect_timeout": self.connect_timeout,
            "read_timeout": self.read_timeout,
            "total_timeout": self.total_timeout,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_redirects < 0 or self.fetch_cache_bytes < 0 or self.decode_memo_bytes < 0:
            raise ValueError("max_redirects and cache sizes must be >= 0")
        if self.decode_queue < 0:
            raise ValueError(f"decode_queue must be >= 0, got {self.decode_queue}")
        if self.decode_memory_bytes < MIN_DECODE_MEMORY:
            raise ValueError(
                f"decode_memory_bytes must be at least {MIN_DECODE_MEMORY} (Pillow and FFmpeg "
                f"alone take about 170 MiB of address space), got {self.decode_memory_bytes}"
            )
        if self.qwen_max_pixels < self.qwen_min_pixels:
            raise ValueError("qwen_max_pixels must be >= qwen_min_pixels")
        if not self.allowed_formats:
            raise ValueError("allowed_formats must name at least one format")
        unknown = [f for f in self.allowed_formats if f not in _KNOWN_FORMATS]
        if unknown:
            raise ValueError(f"unknown image formats {unknown}; known: {sorted(_KNOWN_FORMATS)}")
        for name, allowed, known in (
            ("allowed_audio_containers", self.allowed_audio_containers, KNOWN_AUDIO_CONTAINERS),
            ("allowed_video_containers", self.allowed_video_containers, KNOWN_VIDEO_CONTAINERS),
        ):
            strange = [c for c in allowed if c not in known]
            if strange:
                raise ValueError(
                    f"{name} names unknown containers {strange}; known: {sorted(known)}"
                )
        for network in self.allowed_networks:
            ipaddress.ip_network(network, strict=False)
