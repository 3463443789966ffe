"""Audio and video files made on the spot, in the containers and codecs clients send."""

from __future__ import annotations

import io
import math
import struct
import wave
from fractions import Fraction

import av
import numpy as np


def wav(seconds: float = 1.0, rate: int = 16_000, tone: float = 440.0, channels: int = 1) -> bytes:
    """A PCM 16-bit WAV of a sine ``tone``; another tone gives other bytes."""
    count = int(seconds * rate)
    t = np.arange(count) / rate
    samples = (np.sin(2 * math.pi * tone * t) * 12_000).astype("<i2")
    if channels > 1:
        samples = np.repeat(samples, channels)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


def wav_declaring(data_bytes: int, actual_bytes: int, rate: int = 16_000) -> bytes:
    """A mono 16-bit WAV whose header declares ``data_bytes`` of samples but holds
    ``actual_bytes`` (a lying or truncated header)."""
    header = b"RIFF" + struct.pack("<I", min(36 + data_bytes, 0xFFFF_FFFF)) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
    header += b"data" + struct.pack("<I", data_bytes)
    return header + bytes(actual_bytes)


def encoded_audio(
    container: str, codec: str, seconds: float = 1.0, rate: int = 16_000, tone: float = 440.0
) -> bytes:
    """A clip encoded with PyAV: ``container`` is FFmpeg's muxer name (flac, mp3, ogg, webm,
    mp4)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        assert isinstance(stream, av.AudioStream)
        stream.layout = "mono"
        frame_size = 1024
        total = int(seconds * rate)
        pts = 0
        while pts < total:
            n = min(frame_size, total - pts)
            t = (np.arange(pts, pts + n) / rate).astype("f4")
            samples = (np.sin(2 * math.pi * tone * t) * 0.3).astype("f4").reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
            frame.sample_rate = rate
            frame.pts = pts
            pts += n
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()


def video(
    container: str = "mp4",
    codec: str = "mpeg4",
    frames: int = 8,
    width: int = 64,
    height: int = 48,
    fps: int = 4,
    shade: int = 0,
) -> bytes:
    """A short video of moving gradients; ``shade`` gives other bytes for the same shape."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        stream.time_base = Fraction(1, fps)
        for index in range(frames):
            x = np.arange(width, dtype=np.uint16)
            y = np.arange(height, dtype=np.uint16)[:, None]
            base = ((x + y + (index * 8 + shade) % 256) % 256).astype(np.uint8)
            rgb = np.stack([base, np.roll(base, 7, axis=1), np.full_like(base, shade % 256)], -1)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()
