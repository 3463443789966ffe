"""``data:`` URIs (RFC 2397) to bytes, refusing oversize payloads before decoding them."""

from __future__ import annotations

import binascii
from urllib.parse import unquote_to_bytes

from rankgate.multimodal.errors import MediaRefused


def parse_data_uri(uri: str, max_bytes: int, kind: str = "image") -> tuple[str, bytes]:
    """Return ``(media_type, payload)``; the media type is "" when the URI names none.

    A media type, when named, must be of ``kind`` ("image", "audio", "video"). Base64
    payloads are decoded strictly (no whitespace or stray characters), as vLLM does;
    others are percent-decoded. The size limit is checked on the encoded length first, so a
    huge URI is refused without allocating its decoded form.
    """
    header, comma, payload = uri.partition(",")
    if not comma or not header.lower().startswith("data:"):
        raise MediaRefused("malformed data URI: expected data:[<media type>][;base64],<data>")
    params = header[5:].split(";")
    media_type = params[0].strip().lower()
    is_base64 = any(p.strip().lower() == "base64" for p in params[1:])
    if media_type and not media_type.startswith(f"{kind}/"):
        article = "an" if kind[0] in "aeiou" else "a"
        raise MediaRefused(f"data URI media type {media_type} is not {article} {kind}")
    limit = f"over the limit of {max_bytes} bytes"
    if is_base64:
        if len(payload) // 4 * 3 > max_bytes + 2:
            approx = len(payload) // 4 * 3
            raise MediaRefused(f"data URI payload of about {approx} bytes is {limit}")
        try:
            data = binascii.a2b_base64(payload, strict_mode=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaRefused(f"invalid base64 in data URI: {exc}") from None
    else:
        if len(payload) > 3 * max_bytes:
            raise MediaRefused(f"data URI payload is {limit}")
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaRefused(f"data URI payload of {len(data)} bytes is {limit}")
    if not data:
        raise MediaRefused("data URI has an empty payload")
    return media_type, data
