"""Image preparation cost: decode+hash throughput of a 1024x1024 JPEG, and latency per image.

Prints one table. ``decode+hash`` runs :func:`rankgate.multimodal.decode.decode_image` (Pillow
decode, EXIF check, RGB conversion, SHA-256 of the pixels) on one thread, then through the decoder
processes with the memo off; ``prepare`` times :meth:`MediaPreparer.prepare` for one data-URI image
as the app calls it (base64 decoding and the thread hop included), cold and as a repeat that
the decode memo answers (a chat resending its images every turn).

    .venv/bin/python bench/images.py [--seconds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import statistics
import time

import PIL
from PIL import Image, ImageFilter

from rankgate.multimodal import MediaConfig, MediaPreparer, MediaRef
from rankgate.multimodal.decode import DecodeLimits, ImageDecoder, decode_image
from rankgate.multimodal.isolation import DecoderLimits, DecoderPool

SIDE = 1024


def photo_like_jpeg(seed: int) -> bytes:
    """A 1024x1024 JPEG with gradients and texture, closer to a photo than flat colour or noise."""
    rng = random.Random(seed)
    base = Image.merge(
        "RGB",
        (
            Image.linear_gradient("L").resize((SIDE, SIDE)),
            Image.radial_gradient("L").resize((SIDE, SIDE)),
            Image.linear_gradient("L").rotate(90).resize((SIDE, SIDE)),
        ),
    )
    texture = Image.frombytes("RGB", (SIDE // 4, SIDE // 4), rng.randbytes(SIDE * SIDE * 3 // 16))
    texture = texture.resize((SIDE, SIDE)).filter(ImageFilter.GaussianBlur(2))
    buffer = io.BytesIO()
    Image.blend(base, texture, 0.35).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, per_s: float, samples_ms: list[float]) -> None:
    print(
        f"{name:<34} {per_s:>9.1f} {statistics.median(samples_ms):>9.2f} "
        f"{percentile(samples_ms, 0.99):>9.2f}"
    )


def bench_sync(jpeg: bytes, seconds: float) -> None:
    limits = DecodeLimits(("JPEG",), SIDE * SIDE)
    samples: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        decode_image(jpeg, limits)
        samples.append((time.perf_counter() - t0) * 1000)
    row("decode+hash, 1 thread", len(samples) / sum(samples) * 1000, samples)


async def bench_pool(jpeg: bytes, seconds: float, workers: int) -> None:
    pool = DecoderPool(DecoderLimits(workers=workers))
    decoder = ImageDecoder(DecodeLimits(("JPEG",), SIDE * SIDE), pool, memo_bytes=0)
    samples: list[float] = []
    end = time.perf_counter() + seconds

    async def one_client() -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await decoder.decode(jpeg)
            samples.append((time.perf_counter() - t0) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(workers * 2)))
    elapsed = time.perf_counter() - started
    decoder.close()
    pool.close()
    row(f"decode+hash, pool of {workers}", len(samples) / elapsed, samples)


async def bench_prepare(jpegs: list[bytes], seconds: float, workers: int) -> None:
    preparer = MediaPreparer(MediaConfig(decode_workers=workers, decode_memo_bytes=0))
    uris = [f"data:image/jpeg;base64,{base64.b64encode(j).decode()}" for j in jpegs]
    samples: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        ref = MediaRef(uris[i % len(uris)])
        i += 1
        t0 = time.perf_counter()
        await preparer.prepare([ref])
        samples.append((time.perf_counter() - t0) * 1000)
    row("prepare, 1 image, cold", len(samples) / sum(samples) * 1000, samples)
    await preparer.aclose()

    preparer = MediaPreparer(MediaConfig(decode_workers=workers))
    ref = MediaRef(uris[0])
    await preparer.prepare([ref])
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await preparer.prepare([ref])
        samples.append((time.perf_counter() - t0) * 1000)
    row("prepare, 1 image, repeat (memo)", len(samples) / sum(samples) * 1000, samples)
    await preparer.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    jpegs = [photo_like_jpeg(seed) for seed in range(4)]
    print(
        f"image: {SIDE}x{SIDE} JPEG q90, {len(jpegs[0]) / 1024:.0f} KiB; "
        f"cpus: {os.cpu_count()}; Pillow {PIL.__version__}"
    )
    print(f"{'case':<34} {'images/s':>9} {'p50 ms':>9} {'p99 ms':>9}")
    bench_sync(jpegs[0], args.seconds)
    asyncio.run(bench_pool(jpegs[0], args.seconds, args.workers))
    asyncio.run(bench_prepare(jpegs, args.seconds, args.workers))


if __name__ == "__main__":
    main()
