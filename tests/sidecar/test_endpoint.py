from __future__ import annotations

import pytest

from rankgate.sidecar.endpoint import Endpoint, EndpointError, parse_endpoint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("localhost:50051", Endpoint("localhost", 50051, False)),
        ("grpc://10.0.0.2:9000", Endpoint("10.0.0.2", 9000, False)),
        ("http://vllm:8033/", Endpoint("vllm", 8033, False)),
        ("http://vllm", Endpoint("vllm", 80, False)),
        ("grpcs://vllm.example.com", Endpoint("vllm.example.com", 443, True)),
        ("https://vllm.example.com:8443", Endpoint("vllm.example.com", 8443, True)),
        ("[::1]:50051", Endpoint("::1", 50051, False)),
        ("GRPC://[fe80::1]:1", Endpoint("fe80::1", 1, False)),
    ],
)
def test_accepted_forms(text: str, expected: Endpoint) -> None:
    assert parse_endpoint(text) == expected


def test_target_brackets_ipv6() -> None:
    assert parse_endpoint("[::1]:50051").target == "[::1]:50051"
    assert parse_endpoint("h:1").target == "h:1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("user:pw@host:1", "user-info"),
        ("grpc://user@host:1", "user-info"),
        ("http://host:1/v1", "path"),
        ("http://host:1?x=1", "query"),
        ("http://host:1#frag", "fragment"),
        ("ftp://host:1", "unsupported scheme"),
        ("host", "no port"),
        ("grpc://host", "no port"),
        ("host:abc", "not a number"),
        ("host:5005\xb2", "not a number"),
        ("host:70000", "out of range"),
        ("host:0", "out of range"),
        ("::1:50051", "brackets"),
        ("[::1:50051", "unclosed"),
        ("[nothex]:1", "not an IPv6"),
        (":50051", "no host"),
    ],
)
def test_rejected_forms(text: str, message: str) -> None:
    with pytest.raises(EndpointError, match=message):
        parse_endpoint(text)
