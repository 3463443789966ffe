"""What one image or clip costs the gateway to prepare: latency, and CPU in the gateway's own
process and in any decoder process it runs.

Each case calls :meth:`MediaPreparer.prepare` for one ``data:`` item as a chat request does
(with a token budget, so an image's header is read before it is decoded), the decode memo off
so that every call decodes. ``gateway CPU`` is this process's CPU time per item; ``decoder
CPU`` that of its child processes, read from ``/proc`` (none where decoding runs on threads).
``first`` is a fresh preparer's first item, pool start included. Prints one table; run it on
two trees in turn, e.g. ``PYTHONPATH=/path/to/other/tree``, to compare them.

    .venv/bin/python bench/media_cost.py [--seconds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import math
import os
import random
import statistics
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageFilter

import rankgate.multimodal.decode
from rankgate.multimodal import MediaConfig, MediaPreparer, MediaRef

BUDGET = 1 << 30
_TICK = os.sysconf("SC_CLK_TCK")


def photo_like_jpeg(side: int = 1024, seed: int = 0) -> bytes:
    """A JPEG with gradients and texture, closer to a photo than flat colour or noise."""
    rng = random.Random(seed)
    base = Image.merge(
        "RGB",
        (
            Image.linear_gradient("L").resize((side, side)),
            Image.radial_gradient("L").resize((side, side)),
            Image.linear_gradient("L").rotate(90).resize((side, side)),
        ),
    )
    texture = Image.frombytes("RGB", (side // 4, side // 4), rng.randbytes(side * side * 3 // 16))
    texture = texture.resize((side, side)).filter(ImageFilter.GaussianBlur(2))
    buffer = io.BytesIO()
    Image.blend(base, texture, 0.35).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def audio(container: str, codec: str, seconds: float, rate: int = 16_000) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        assert isinstance(stream, av.AudioStream)
        stream.layout = "mono"
        total, pts = int(seconds * rate), 0
        while pts < total:
            n = min(1152, total - pts)
            t = (np.arange(pts, pts + n) / rate).astype("f4")
            samples = (np.sin(2 * math.pi * 440 * t) * 0.3).astype("f4").reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
            frame.sample_rate, frame.pts = rate, pts
            pts += n
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()


def video(frames: int = 64, width: int = 320, height: int = 240, fps: int = 8) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        x = np.arange(width, dtype=np.uint16)
        y = np.arange(height, dtype=np.uint16)[:, None]
        for index in range(frames):
            plane = ((x + y + index * 8) % 256).astype(np.uint8)
            rgb = np.stack([plane, np.roll(plane, 7, axis=1), np.full_like(plane, 90)], -1)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()


def children_cpu() -> float:
    """CPU seconds of this process's live children, from ``/proc``."""
    total = 0.0
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def one_case(
    ref: MediaRef, seconds: float, workers: int
) -> tuple[float, list[float], float, float]:
    """First-item latency, per-item latencies, gateway and decoder CPU per item."""
    preparer = MediaPreparer(MediaConfig(decode_workers=workers, decode_memo_bytes=0))
    try:
        t0 = time.perf_counter()
        await preparer.prepare([ref], BUDGET)
        first = time.perf_counter() - t0
        samples: list[float] = []
        cpu0, kids0 = time.process_time(), children_cpu()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(samples) < 5:
            t0 = time.perf_counter()
            await preparer.prepare([ref], BUDGET)
            samples.append(time.perf_counter() - t0)
        gateway = (time.process_time() - cpu0) / len(samples)
        decoders = (children_cpu() - kids0) / len(samples)
        return first, samples, gateway, decoders
    finally:
        await preparer.aclose()


async def throughput(ref: MediaRef, seconds: float, workers: int, clients: int) -> float:
    preparer = MediaPreparer(MediaConfig(decode_workers=workers, decode_memo_bytes=0))
    try:
        await preparer.prepare([ref], BUDGET)
        done = 0
        end = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await preparer.prepare([ref], BUDGET)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return done / (time.perf_counter() - started)
    finally:
        await preparer.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    cases = {
        "image 1024x1024 JPEG": MediaRef(uri("image/jpeg", photo_like_jpeg())),
        "audio 10 s WAV": MediaRef(uri("audio/wav", audio("wav", "pcm_s16le", 10)), kind="audio"),
        "audio 30 s MP3": MediaRef(uri("audio/mpeg", audio("mp3", "libmp3lame", 30)), kind="audio"),
        "video 64 frames 320x240 H.264": MediaRef(uri("video/mp4", video()), kind="video"),
    }
    tree = Path(rankgate.multimodal.decode.__file__).parents[2]
    print(f"tree: {tree}; cpus: {os.cpu_count()}; decode workers: {args.workers}")
    print(
        f"{'case':<30} {'first ms':>9} {'p50 ms':>8} {'p99 ms':>8} {'gw CPU ms':>10} "
        f"{'dec CPU ms':>10} {'items/s x4':>10}"
    )
    for name, ref in cases.items():
        first, samples, gateway, decoders = asyncio.run(one_case(ref, args.seconds, args.workers))
        rate = asyncio.run(throughput(ref, args.seconds, args.workers, 4))
        ordered = sorted(samples)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        print(
            f"{name:<30} {first * 1000:>9.1f} {statistics.median(samples) * 1000:>8.2f} "
            f"{p99 * 1000:>8.2f} {gateway * 1000:>10.2f} {decoders * 1000:>10.2f} {rate:>10.1f}"
        )


if __name__ == "__main__":
    main()
