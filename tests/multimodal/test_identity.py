"""The canonical hash: same pixels, one id, whatever the container; the documented layout."""

from __future__ import annotations

import hashlib
import struct

import pytest
from PIL import Image

from multimodal.decode import DecodeLimits, decode_image
from multimodal.identity import canonical_rgb, pixel_identity, url_identity
from tests.multimodal.pictures import encode, noise

LIMITS = DecodeLimits(("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"), 10_000_000)


def uuid_of(data: bytes) -> str:
    return decode_image(data, LIMITS).uuid


def test_the_id_is_sha256_over_the_documented_layout() -> None:
    image = noise(7, 5)
    expected = hashlib.sha256(
        b"rankgate-image-v1\x00RGB\x00" + struct.pack(">II", 7, 5) + image.tobytes()
    ).hexdigest()
    assert pixel_identity(image) == expected
    assert uuid_of(encode(image, "PNG")) == expected
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
def test_lossless_reencodings_share_the_png_id(fmt: str, params: dict[str, object]) -> None:
    image = noise(33, 17, seed=3)
    assert uuid_of(encode(image, fmt, **params)) == uuid_of(encode(image, "PNG"))


def test_lossy_and_different_pictures_get_other_ids() -> None:
    image = noise(32, 32, seed=1)
    png = uuid_of(encode(image, "PNG"))
    assert uuid_of(encode(image, "JPEG", quality=90)) != png
    assert uuid_of(encode(noise(32, 32, seed=2), "PNG")) != png


def test_size_is_part_of_the_id_not_only_the_pixel_bytes() -> None:
    wide = noise(6, 2, seed=4)
    tall = Image.frombytes("RGB", (2, 6), wide.tobytes())
    assert pixel_identity(wide) != pixel_identity(tall)


def test_alpha_is_composited_over_white_as_vllm_does() -> None:
    rgba = noise(8, 8, "RGBA", seed=5)
    flat = Image.new("RGB", rgba.size, (255, 255, 255))
    flat.paste(rgba, mask=rgba.getchannel("A"))
    assert uuid_of(encode(rgba, "PNG")) == pixel_identity(flat)
    assert uuid_of(encode(rgba, "WEBP", lossless=True, exact=True)) == pixel_identity(flat)


def test_colours_under_full_transparency_do_not_change_the_id() -> None:
    a = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    b = Image.new("RGBA", (4, 4), (200, 100, 0, 0))
    assert uuid_of(encode(a, "PNG")) == uuid_of(encode(b, "PNG"))
    assert uuid_of(encode(a, "PNG")) == pixel_identity(Image.new("RGB", (4, 4), "white"))


def test_grey_and_palette_images_hash_as_their_rgb_form() -> None:
    grey = noise(9, 9, "L", seed=6)
    assert uuid_of(encode(grey, "PNG")) == pixel_identity(grey.convert("RGB"))
    assert uuid_of(encode(grey, "WEBP", lossless=True)) == uuid_of(encode(grey, "PNG"))
    palette = noise(9, 9, seed=7).quantize(16)
    assert uuid_of(encode(palette, "PNG")) == uuid_of(encode(palette.convert("RGB"), "PNG"))


def test_canonical_rgb_refuses_nothing_and_pixel_identity_needs_rgb() -> None:
    assert canonical_rgb(noise(2, 2, "CMYK")).mode == "RGB"
    with pytest.raises(ValueError, match="RGB"):
        pixel_identity(noise(2, 2, "L"))


def test_url_identity_is_stable_and_distinct() -> None:
    url = "https://images.example.com/cat.png"
    assert url_identity(url) == url_identity(url)
    assert url_identity(url) != url_identity(url + "?v=2")
    assert len(url_identity(url)) == 64
    assert int(url_identity(url), 16) >= 0
