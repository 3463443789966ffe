"""Media identities: the 64-hex id each image, audio clip or video is sent with as
``MediaItem.uuid``.

The id of an item whose bytes the gateway sends is **BLAKE3 over those bytes**, hex-encoded:
exactly the identifier vLLM's own HTTP server (the Rust frontend of vLLM 0.32) computes for the
same image, audio clip or video, as it appears in its KV events' ``extra_keys``. So a client
that talks to vLLM directly and one that comes through the gateway share vLLM's encoder and
prefix caches and our router's block keys, and the id is checked against real vLLM rather
than against itself.

It identifies the encoded file, not the picture: a lossless re-encoding (PNG, then WebP, of
the same pixels) gets another id and its own cache entries, which is never wrong, only less
sharing. Clients resend the same bytes turn after turn, and mixed traffic is the case worth
winning; hashing bytes also costs far less than hashing decoded pixels. When EXIF orientation
has to be applied, the gateway sends (and so identifies) the turned pixels as a PNG.

In pass-through mode the gateway never sees the bytes and identifies an image by
:func:`url_identity`, a hash of the URL text: weaker, as one picture at two URLs gets two ids.
"""

from __future__ import annotations

import hashlib

from blake3 import blake3
from PIL import Image

CANONICAL_MODE = "RGB"
_URL_TAG = b"rankgate-image-url-v1\x00"
_WHITE = (255, 255, 255)


def content_identity(data: bytes) -> str:
    """The 64-hex id of an image sent as ``data`` (vLLM's own id for those bytes)."""
    return blake3(data).hexdigest()


def canonical_rgb(image: Image.Image) -> Image.Image:
    """The RGB image vLLM derives from ``image`` (alpha over white, as vLLM's default)."""
    if image.mode == CANONICAL_MODE:
        return image
    if image.mode == "RGBA":
        flat = Image.new(CANONICAL_MODE, image.size, _WHITE)
        flat.paste(image, mask=image.getchannel("A"))
        return flat
    return image.convert(CANONICAL_MODE)


def url_identity(url: str) -> str:
    """The 64-hex id of an image known only by its URL (pass-through mode)."""
    return hashlib.sha256(_URL_TAG + url.encode()).hexdigest()
