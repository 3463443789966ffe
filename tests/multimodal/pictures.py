"""Real image bytes made with Pillow, for tests: deterministic, small, in any format."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib

from PIL import Image


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A picture whose every pixel matters, so lossless round trips are checked for real."""
    bands = len(mode)
    rng = random.Random(seed)
    return Image.frombytes(mode, (width, height), rng.randbytes(width * height * bands))


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_claiming(width: int, height: int) -> bytes:
    """A tiny, valid-looking PNG whose header claims ``width`` x ``height`` pixels."""
    small = encode(Image.new("L", (1, 1)), "PNG")
    ihdr_at = 8
    length = struct.unpack(">I", small[ihdr_at : ihdr_at + 4])[0]
    body = bytearray(small[ihdr_at + 4 : ihdr_at + 8 + length])
    body[4:12] = struct.pack(">II", width, height)
    crc = struct.pack(">I", zlib.crc32(bytes(body)))
    return small[: ihdr_at + 4] + bytes(body) + crc + small[ihdr_at + 12 + length :]
