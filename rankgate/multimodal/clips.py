"""Audio and video clips: told by their first bytes, measured and checked with PyAV (FFmpeg).

Only containers on the operator's allow-list reach FFmpeg, and each is opened with its own
demuxer named, so FFmpeg never guesses a format from hostile bytes. Nothing a header says is
trusted: an audio clip is decoded in full, counting samples as it goes, and refused the moment
it passes the duration or decoded-size limit (a header may claim one second and the data hold
an hour); a video's packets are counted without decoding them, which gives its true frame
count and span, and only its first frame is decoded, to prove the codec can. So the work a
clip costs is bounded by the limits, whatever it declares, and it is always done in one of the
gateway's decoder processes (:class:`ClipDecoder`, :mod:`rankgate.multimodal.isolation`), never
in the gateway's own.

Identity is the same as for images: BLAKE3 over the bytes sent
(:mod:`rankgate.multimodal.identity`).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any

import av
import msgspec

from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.identity import content_identity
from rankgate.multimodal.isolation import DecoderPool
from rankgate.multimodal.lru import BoundedLRU
from rankgate.multimodal.types import MediaKind

# Container name -> FFmpeg demuxer; MIME types by kind.
_DEMUXERS = {
    "wav": "wav",
    "flac": "flac",
    "mp3": "mp3",
    "ogg": "ogg",
    "webm": "matroska",
    "mp4": "mov",
    "avi": "avi",
}
_MIME = {
    ("audio", "wav"): "audio/wav",
    ("audio", "flac"): "audio/flac",
    ("audio", "mp3"): "audio/mpeg",
    ("audio", "ogg"): "audio/ogg",
    ("audio", "webm"): "audio/webm",
    ("audio", "mp4"): "audio/mp4",
    ("video", "mp4"): "video/mp4",
    ("video", "webm"): "video/webm",
    ("video", "avi"): "video/x-msvideo",
}
AUDIO_CODECS = frozenset(
    {
        "pcm_s16le",
        "pcm_s16be",
        "pcm_s24le",
        "pcm_s32le",
        "pcm_f32le",
        "pcm_f64le",
        "pcm_u8",
        "pcm_mulaw",
        "pcm_alaw",
        "flac",
        "mp3",
        "mp3float",
        "vorbis",
        "opus",
        "aac",
    }
)
VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"})
_MAX_SAMPLE_RATE = 384_000
# Declared and decoded durations of formats that state theirs exactly may differ by this much
# before a clip counts as truncated.
_EXACT_DURATIONS = frozenset({"wav", "flac", "mp4"})
_TRUNCATION_SLACK = 0.05
# Chunks walked to find a WAV's data chunk (fmt, fact, LIST, ... come before it).
_WAV_MAX_CHUNKS = 32


class ClipLimits(msgspec.Struct, frozen=True, kw_only=True):
    kind: MediaKind
    containers: tuple[str, ...]
    max_seconds: float
    max_decoded_bytes: int = 0
    max_frames: int = 0
    max_frame_pixels: int = 0


class ProbedClip(msgspec.Struct, frozen=True, kw_only=True):
    """A validated clip: its identity, what it measures, and the bytes to send."""

    uuid: str
    kind: MediaKind
    mime_type: str
    container: str
    codec: str
    seconds: float
    data: bytes
    sample_rate: int = 0
    samples: int = 0
    width: int = 0
    height: int = 0
    frames: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """What the number of tokens vLLM makes of the clip can depend on: a count learnt for
        one clip stands for another of the same shape."""
        if self.kind == "audio":
            return (3, self.sample_rate, self.samples)
        return (2, self.width, self.height, self.frames, round(self.seconds * 1000))


def sniff_container(data: bytes) -> str | None:
    """The container ``data`` starts like, from its magic bytes alone."""
    head = data[:12]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head[:3] == b"ID3" or (len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def probe_clip(data: bytes, limits: ClipLimits) -> ProbedClip:
    """Validate and measure ``data``; blocking, and in the gateway meant for a decoder process.

    Running out of memory is not a refusal: the decoder process reports it as such."""
    kind = limits.kind
    if not data:
        raise MediaRefused(f"empty {kind} data")
    allowed = ", ".join(limits.containers)
    container = sniff_container(data)
    if container is None:
        raise MediaRefused(f"unrecognised {kind} data (allowed containers: {allowed})")
    if container not in limits.containers or (kind, container) not in _MIME:
        raise MediaRefused(f"{kind} container {container} is not allowed (allowed: {allowed})")
    try:
        with av.open(io.BytesIO(data), mode="r", format=_DEMUXERS[container]) as opened:
            if kind == "audio":
                return _probe_audio(opened, container, data, limits)
            return _probe_video(opened, container, data, limits)
    except (MediaRefused, MemoryError):
        raise
    except (av.FFmpegError, EOFError, ValueError, OverflowError, ZeroDivisionError) as exc:
        raise MediaRefused(f"corrupt or truncated {container} {kind}: {exc}") from None


def _declared_seconds(stream: Any, container: Any) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return float(container.duration) / 1_000_000
    return None


def _wav_declared_seconds(data: bytes) -> float | None:
    """The seconds a WAV's own header declares: its data chunk's size over its byte rate.

    FFmpeg's demuxer clamps a data size larger than the file to the bytes present, so the
    duration it reports never shows what the header claims; this reads the claim itself.
    ``0`` and ``0xFFFFFFFF`` are the sizes streaming writers leave when they cannot know it.
    """
    at, byte_rate, chunks = 12, 0, 0
    while at + 8 <= len(data) and chunks < _WAV_MAX_CHUNKS:
        name, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        if name == b"fmt " and size >= 16 and at + 24 <= len(data):
            byte_rate = int.from_bytes(data[at + 16 : at + 20], "little")
        elif name == b"data":
            if byte_rate <= 0 or size in (0, 0xFFFFFFFF):
                return None
            return size / byte_rate
        at += 8 + size + (size & 1)
        chunks += 1
    return None


def _over(kind: str, what: str, limit: float, unit: str) -> MediaRefused:
    return MediaRefused(f"{kind} {what}, over the limit of {limit:g} {unit}")


def _probe_audio(opened: Any, container: str, data: bytes, limits: ClipLimits) -> ProbedClip:
    if not opened.streams.audio:
        raise MediaRefused(f"the {container} data has no audio stream")
    stream = opened.streams.audio[0]
    context = stream.codec_context
    codec = context.name
    if codec not in AUDIO_CODECS:
        raise MediaRefused(f"audio codec {codec} is not supported")
    rate = int(context.sample_rate or 0)
    if not 0 < rate <= _MAX_SAMPLE_RATE:
        raise MediaRefused(f"audio sample rate {rate} is out of range (1 to {_MAX_SAMPLE_RATE})")
    declared = _declared_seconds(stream, opened)
    claimed = _wav_declared_seconds(data) if container == "wav" else None
    for said in (declared, claimed):
        if said is not None and said > limits.max_seconds:
            raise _over("audio", f"declares {said:.1f} s", limits.max_seconds, "s")
    context.thread_count = 1
    max_samples = int(limits.max_seconds * rate)
    samples = 0
    decoded = 0
    for frame in opened.decode(stream):
        samples += frame.samples
        decoded += sum(plane.buffer_size for plane in frame.planes)
        if samples > max_samples:
            raise _over("audio", "decodes to more", limits.max_seconds, "s")
        if decoded > limits.max_decoded_bytes:
            raise _over("audio", "decodes to more", limits.max_decoded_bytes, "bytes")
    if samples == 0:
        raise MediaRefused(f"the {container} audio holds no samples")
    seconds = samples / rate
    if (
        container in _EXACT_DURATIONS
        and declared is not None
        and declared > seconds * (1 + _TRUNCATION_SLACK) + _TRUNCATION_SLACK
    ):
        raise MediaRefused(
            f"truncated {container} audio: its header declares {declared:.2f} s, "
            f"its data holds {seconds:.2f} s"
        )
    return ProbedClip(
        uuid=content_identity(data),
        kind="audio",
        mime_type=_MIME[("audio", container)],
        container=container,
        codec=codec,
        seconds=seconds,
        data=data,
        sample_rate=rate,
        samples=samples,
    )


def _probe_video(opened: Any, container: str, data: bytes, limits: ClipLimits) -> ProbedClip:
    if not opened.streams.video:
        raise MediaRefused(f"the {container} data has no video stream")
    stream = opened.streams.video[0]
    context = stream.codec_context
    codec = context.name
    if codec not in VIDEO_CODECS:
        raise MediaRefused(f"video codec {codec} is not supported")
    width, height = int(context.width or 0), int(context.height or 0)
    if width <= 0 or height <= 0:
        raise MediaRefused(f"invalid video frame size {width}x{height}")
    if width * height > limits.max_frame_pixels:
        raise _over(
            "video", f"frames of {width}x{height} are {width * height} pixels",
            limits.max_frame_pixels, "pixels",
        )  # fmt: skip
    declared = _declared_seconds(stream, opened)
    if declared is not None and declared > limits.max_seconds:
        raise _over("video", f"declares {declared:.1f} s", limits.max_seconds, "s")
    if stream.frames and stream.frames > limits.max_frames:
        raise _over("video", f"declares {stream.frames} frames", limits.max_frames, "frames")
    frames, seconds = _count_packets(opened, stream, limits)
    if frames == 0:
        raise MediaRefused(f"the {container} video holds no frames")
    _decode_first_frame(data, container, limits)
    return ProbedClip(
        uuid=content_identity(data),
        kind="video",
        mime_type=_MIME[("video", container)],
        container=container,
        codec=codec,
        seconds=seconds,
        data=data,
        width=width,
        height=height,
        frames=frames,
    )


def _count_packets(opened: Any, stream: Any, limits: ClipLimits) -> tuple[int, float]:
    """The true frame count and span, from the packets alone (nothing is decoded)."""
    base: Fraction = stream.time_base or Fraction(1, 1_000_000)
    frames = 0
    first: int | None = None
    end: int | None = None
    for packet in opened.demux(stream):
        if packet.size == 0:
            continue
        frames += 1
        if frames > limits.max_frames:
            raise _over("video", "holds more frames", limits.max_frames, "frames")
        stamp = packet.pts if packet.pts is not None else packet.dts
        if stamp is None:
            continue
        first = stamp if first is None else min(first, stamp)
        stop = stamp + (packet.duration or 0)
        end = stop if end is None else max(end, stop)
        if float((end - first) * base) > limits.max_seconds:
            raise _over("video", "runs longer", limits.max_seconds, "s")
    seconds = float((end - first) * base) if first is not None and end is not None else 0.0
    return frames, seconds


def _decode_first_frame(data: bytes, container: str, limits: ClipLimits) -> None:
    """Decode one frame: the codec's parameters may still lie where the packets cannot."""
    with av.open(io.BytesIO(data), mode="r", format=_DEMUXERS[container]) as opened:
        stream = opened.streams.video[0]
        stream.codec_context.thread_count = 1
        for frame in opened.decode(stream):
            if frame.width * frame.height > limits.max_frame_pixels:
                raise _over(
                    "video", f"frames decode to {frame.width}x{frame.height}",
                    limits.max_frame_pixels, "pixels",
                )  # fmt: skip
            return
    raise MediaRefused(f"no frame of the {container} video could be decoded")


class ClipDecoder:
    """Runs :func:`probe_clip` in ``pool``'s decoder processes and remembers recent results.

    As for images, the memo is keyed by a digest of the bytes, so a conversation that resends
    the same clip every turn pays one hash for it, not a decode. Threads hash, recall and wait
    on the decoders; at most ``workers * 2`` jobs are handed to them at once, the rest wait on
    the event loop, and the pool refuses jobs past its queue.
    """

    def __init__(self, audio: ClipLimits, video: ClipLimits, pool: DecoderPool, memo: int) -> None:
        self._params = {
            "audio": msgspec.msgpack.encode(audio),
            "video": msgspec.msgpack.encode(video),
        }
        self._pool = pool
        workers = pool.limits.workers
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rankgate-clip")
        self._slots = asyncio.Semaphore(workers * 2)
        self._memo: BoundedLRU[bytes, ProbedClip] = BoundedLRU(memo, cost=lambda _: 256)
        self._memo_lock = threading.Lock()
        self.decoded = 0
        self.recalled = 0

    async def probe(self, kind: MediaKind, data: bytes) -> ProbedClip:
        with self._pool.admitted():
            async with self._slots:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._threads, self._probe_or_recall, kind, data)

    def _probe_or_recall(self, kind: MediaKind, data: bytes) -> ProbedClip:
        digest = hashlib.sha256(kind.encode() + b"\x00")
        digest.update(data)
        key = digest.digest()
        with self._memo_lock:
            hit = self._memo.get(key)
            if hit is not None:
                self.recalled += 1
        if hit is not None:
            return msgspec.structs.replace(hit, data=data)
        probed = self._pool.run("clip", self._params[kind], data, ProbedClip)
        with self._memo_lock:
            self.decoded += 1
            self._memo.put(key, probed)
        return msgspec.structs.replace(probed, data=data)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
