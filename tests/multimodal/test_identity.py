"""Image ids: BLAKE3 of the bytes sent, vLLM's own id for them; what that does and does not merge.

That the id equals vLLM's is checked against real vLLM in ``test_real_vllm_images.py``.
"""

from __future__ import annotations

import pytest
from blake3 import blake3
from PIL import Image

from rankgate.multimodal.decode import DecodeLimits, decode_image
from rankgate.multimodal.identity import canonical_rgb, content_identity, url_identity
from tests.multimodal.pictures import encode, noise

LIMITS = DecodeLimits(("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"), 10_000_000)


def uuid_of(data: bytes) -> str:
    return decode_image(data, LIMITS).uuid


def test_the_id_is_blake3_of_the_bytes_sent() -> None:
    data = encode(noise(7, 5), "PNG")
    expected = blake3(data).hexdigest()
    assert content_identity(data) == expected
    assert uuid_of(data) == expected
    assert len(expected) == 64


@pytest.mark.parametrize(
    ("fmt", "params"),
    [
        ("WEBP", {"lossless": True}),
        ("BMP", {}),
        ("TIFF", {"compression": "tiff_lzw"}),
        ("PNG", {"optimize": True, "compress_level": 9}),
    ],
)
def test_reencodings_of_one_picture_get_their_own_ids(fmt: str, params: dict[str, object]) -> None:
    """The trade for agreeing with vLLM: ids name files, so re-encodings never merge."""
    image = noise(33, 17, seed=3)
    assert uuid_of(encode(image, fmt, **params)) != uuid_of(encode(image, "PNG"))


def test_the_same_bytes_always_get_the_same_id_and_other_pictures_another() -> None:
    image = noise(32, 32, seed=1)
    png = encode(image, "PNG")
    assert uuid_of(png) == uuid_of(bytes(png))
    assert uuid_of(encode(noise(32, 32, seed=2), "PNG")) != uuid_of(png)


def test_an_image_turned_by_exif_is_identified_by_the_png_sent() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    decoded = decode_image(encode(noise(30, 20, seed=9), "PNG", exif=exif), LIMITS)
    assert decoded.uuid == content_identity(decoded.data)


def test_canonical_rgb_composites_alpha_over_white() -> None:
    rgba = Image.new("RGBA", (2, 2), (10, 20, 30, 0))
    assert canonical_rgb(rgba).getpixel((0, 0)) == (255, 255, 255)
    assert canonical_rgb(noise(2, 2, "CMYK")).mode == "RGB"


def test_url_identity_is_stable_and_distinct() -> None:
    url = "https://images.example.com/cat.png"
    assert url_identity(url) == url_identity(url)
    assert url_identity(url) != url_identity(url + "?v=2")
    assert len(url_identity(url)) == 64
    assert int(url_identity(url), 16) >= 0
