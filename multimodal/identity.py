"""Canonical image identities: one 64-hex id per picture, whatever bytes carried it.

The id of a decoded image is ``sha256`` over, in order:

1. the domain tag ``b"rankgate-image-v1\\x00"`` (bumped if the definition ever changes);
2. the canonical mode ``b"RGB"`` and a ``\\x00`` byte;
3. width and height as two unsigned 32-bit big-endian integers;
4. the pixel bytes of the canonical image, row-major, 3 bytes per pixel (Pillow ``tobytes()``).

The canonical image is the first frame, EXIF orientation applied, converted to RGB exactly as
vLLM converts what it feeds the model: RGBA is composited over white, any other mode goes
through Pillow's ``convert("RGB")``. Hashing what the model sees (not the transport bytes)
makes a PNG, a lossless WebP and a URL serving either share one id, so they share vLLM's
encoder and prefix caches and our router's block keys; two images that differ only where the
model cannot see (e.g. colours under full transparency) share one too, which is correct.

In pass-through mode the gateway never sees the pixels and identifies an image by
:func:`url_identity`, a hash of the URL text: weaker, as one picture at two URLs gets two ids.
"""

from __future__ import annotations

import hashlib
import struct

from PIL import Image

CANONICAL_MODE = "RGB"
_PIXEL_TAG = b"rankgate-image-v1\x00" + CANONICAL_MODE.encode() + b"\x00"
_URL_TAG = b"rankgate-image-url-v1\x00"
_WHITE = (255, 255, 255)


def canonical_rgb(image: Image.Image) -> Image.Image:
    """The RGB image vLLM derives from ``image`` (alpha over white, as vLLM's default)."""
    if image.mode == CANONICAL_MODE:
        return image
    if image.mode == "RGBA":
        flat = Image.new(CANONICAL_MODE, image.size, _WHITE)
        flat.paste(image, mask=image.getchannel("A"))
        return flat
    return image.convert(CANONICAL_MODE)


def pixel_identity(image: Image.Image) -> str:
    """The 64-hex id of a canonical (RGB) image; see the module docstring for the layout."""
    if image.mode != CANONICAL_MODE:
        raise ValueError(f"pixel_identity needs a {CANONICAL_MODE} image, got {image.mode}")
    digest = hashlib.sha256(_PIXEL_TAG)
    digest.update(struct.pack(">II", image.width, image.height))
    digest.update(image.tobytes())
    return digest.hexdigest()


def url_identity(url: str) -> str:
    """The 64-hex id of an image known only by its URL (pass-through mode)."""
    return hashlib.sha256(_URL_TAG + url.encode()).hexdigest()
