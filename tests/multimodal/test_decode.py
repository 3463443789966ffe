"""Decoding and validation: formats, bombs, truncation, corruption, EXIF, the memo."""

from __future__ import annotations

import asyncio

import pytest
from PIL import Image

from rankgate.multimodal.decode import DecodeLimits, ImageDecoder, decode_image, sniff_format
from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.identity import content_identity
from rankgate.multimodal.isolation import DecoderLimits, DecoderPool
from tests.multimodal.pictures import encode, noise, png_claiming

LIMITS = DecodeLimits(("JPEG", "PNG", "WEBP", "GIF"), 4_000_000)


def refusal(data: bytes, limits: DecodeLimits = LIMITS) -> str:
    with pytest.raises(MediaRefused) as caught:
        decode_image(data, limits)
    assert caught.value.status == 400
    return caught.value.reason


@pytest.mark.parametrize(
    ("fmt", "mime"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")],
)
def test_allowed_formats_decode_with_size_and_mime(fmt: str, mime: str) -> None:
    data = encode(noise(40, 30), fmt)
    decoded = decode_image(data, LIMITS)
    assert (decoded.width, decoded.height, decoded.mime_type) == (40, 30, mime)
    assert decoded.data is data


@pytest.mark.parametrize(("fmt", "name"), [("BMP", "BMP"), ("TIFF", "TIFF")])
def test_disallowed_format_is_named(fmt: str, name: str) -> None:
    reason = refusal(encode(noise(8, 8), fmt))
    assert reason == f"format {name} is not allowed (allowed: JPEG, PNG, WEBP, GIF)"


def test_decompression_bomb_is_refused_from_the_header() -> None:
    bomb = png_claiming(100_000, 100_000)
    assert len(bomb) < 100
    reason = refusal(bomb)
    assert reason.startswith("decompression bomb refused: Image size (10000000000 pixels)")
    moderate = refusal(png_claiming(5000, 5000))
    assert moderate == (
        "5000x5000 is 25000000 pixels, over the limit of 4000000 (decompression bomb guard)"
    )


def test_max_pixels_counts_width_times_height() -> None:
    limits = DecodeLimits(("PNG",), 100 * 100)
    assert decode_image(encode(noise(100, 100), "PNG"), limits).width == 100
    assert "over the limit of 10000" in refusal(encode(noise(101, 100), "PNG"), limits)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_image_is_refused(fmt: str) -> None:
    data = encode(noise(64, 64), fmt)
    reason = refusal(data[: len(data) // 2])
    assert reason.startswith(("truncated", "corrupt"))
    assert fmt in reason or "unrecognised" in reason


def test_truncated_png_says_truncated() -> None:
    data = encode(noise(64, 64), "PNG")
    assert refusal(data[: len(data) // 2]).startswith("truncated PNG data")


def test_garbage_and_empty_are_refused() -> None:
    assert refusal(b"this is not an image at all").startswith("corrupt or unrecognised")
    assert refusal(b"") == "empty image data"


def test_corrupt_png_body_is_refused() -> None:
    data = bytearray(encode(noise(32, 32), "PNG"))
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    assert refusal(bytes(data)).startswith(("corrupt PNG", "truncated PNG"))


@pytest.mark.parametrize(("orientation", "turn"), [(6, Image.Transpose.ROTATE_270), (3, None)])
def test_exif_orientation_is_applied_and_the_turned_pixels_are_sent(
    orientation: int, turn: Image.Transpose | None
) -> None:
    image = noise(30, 20, seed=9)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(image, "PNG", exif=exif)
    decoded = decode_image(data, LIMITS)
    upright = image.transpose(turn or Image.Transpose.ROTATE_180)
    assert (decoded.width, decoded.height) == upright.size
    assert decoded.uuid == content_identity(decoded.data)
    assert decoded.mime_type == "image/png"
    assert decoded.data != data
    assert decode_image(decoded.data, LIMITS).uuid == decoded.uuid


def test_animated_gif_uses_its_first_frame() -> None:
    frames = [noise(10, 10, seed=s).quantize(64) for s in range(3)]
    buffer = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(buffer, LIMITS).uuid == content_identity(buffer)


def test_sniff_names_common_formats() -> None:
    assert sniff_format(encode(noise(2, 2), "BMP")) == "BMP"
    assert sniff_format(encode(noise(2, 2), "WEBP")) == "WEBP"
    assert sniff_format(b"\x00") is None


async def test_decoder_pool_decodes_concurrently_and_recalls_repeats() -> None:
    pool = DecoderPool(DecoderLimits(workers=2))
    decoder = ImageDecoder(LIMITS, pool, memo_bytes=1 << 20)
    try:
        datas = [encode(noise(50, 50, seed=s), "PNG") for s in range(4)]
        first = await asyncio.gather(*(decoder.decode(d) for d in datas))
        again = await decoder.decode(bytes(datas[0]))
        assert again.uuid == first[0].uuid
        assert again.data == datas[0]
        assert (decoder.decoded, decoder.recalled) == (4, 1)
        with pytest.raises(MediaRefused):
            await decoder.decode(b"nope")
        assert await decoder.size(bytes(datas[1])) == (50, 50)
        assert pool.started <= 2
    finally:
        decoder.close()
        pool.close()
