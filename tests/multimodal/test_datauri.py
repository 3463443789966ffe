from __future__ import annotations

import base64

import pytest

from rankgate.multimodal.datauri import parse_data_uri
from rankgate.multimodal.errors import MediaRefused


def test_base64_and_percent_encoded_payloads() -> None:
    raw = bytes(range(256))
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    assert parse_data_uri(uri, 1000) == ("image/png", raw)
    assert parse_data_uri("data:,%89PNG", 100) == ("", b"\x89PNG")


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("data:image/png;base64", "malformed data URI"),
        ("data:text/plain;base64,aGk=", "media type text/plain is not an image"),
        ("data:image/png;base64,a b=", "invalid base64"),
        ("data:image/png;base64,", "empty payload"),
        ("data:image/png;base64,@@@@", "invalid base64"),
    ],
)
def test_bad_uris_are_refused(uri: str, reason: str) -> None:
    with pytest.raises(MediaRefused, match=reason):
        parse_data_uri(uri, 100)


def test_oversize_payload_is_refused_before_and_after_decoding() -> None:
    big = "data:image/png;base64," + "A" * 4000
    with pytest.raises(MediaRefused, match="about 3000 bytes is over the limit of 100 bytes"):
        parse_data_uri(big, 100)
    edge = "data:image/png;base64," + base64.b64encode(b"x" * 101).decode()
    with pytest.raises(MediaRefused, match="101 bytes is over the limit of 100 bytes"):
        parse_data_uri(edge, 100)
