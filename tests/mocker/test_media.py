"""Media items: sources, validation and the expanded prompt length."""

from __future__ import annotations

import base64
import io

import grpc
import pytest
from PIL import Image

from rankgate.wire.proto.vllm import control_pb2, inference_pb2
from tests.mocker.conftest import Client, engine, prompt, request

IMAGE = 5


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (0, 120, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def with_media(tokens: list[int], *items: inference_pb2.MediaItem) -> inference_pb2.GenerateRequest:
    req = request(tokens)
    req.media.extend(items)
    return req


def test_data_uri_and_raw_bytes_expand_alike(client: Client) -> None:
    data = png(84, 28)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    tokens = [*prompt(1, 4), IMAGE, *prompt(2, 4), IMAGE]
    reply = client.stream(
        with_media(
            tokens,
            inference_pb2.MediaItem(modality=inference_pb2.MODALITY_IMAGE, data_uri=uri),
            inference_pb2.MediaItem(modality=inference_pb2.MODALITY_IMAGE, raw_bytes=data),
        )
    )
    # Each 84x28 image is 3 tokens at 28-pixel patches; the two placeholders become 6.
    assert reply[0].prompt_info.num_prompt_tokens == len(tokens) - 2 + 6


def test_placeholder_count_must_match(client: Client) -> None:
    item = inference_pb2.MediaItem(modality=inference_pb2.MODALITY_IMAGE, raw_bytes=png(28, 28))
    with pytest.raises(grpc.RpcError) as caught:
        client.stream(with_media(prompt(3, 8), item))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "placeholder" in (caught.value.details() or "")


def test_media_need_token_ids(client: Client) -> None:
    req = inference_pb2.GenerateRequest(text="look <|image|>")
    req.media.add(modality=inference_pb2.MODALITY_IMAGE, raw_bytes=png(28, 28))
    with pytest.raises(grpc.RpcError) as caught:
        client.inference.Generate(req, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "multimodal gRPC requests must provide token_ids input"


def test_undecodable_image_is_a_clear_error(client: Client) -> None:
    item = inference_pb2.MediaItem(modality=inference_pb2.MODALITY_IMAGE, raw_bytes=b"not png")
    with pytest.raises(grpc.RpcError) as caught:
        client.stream(with_media([IMAGE], item))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "media[0]" in (caught.value.details() or "")


def test_multimodal_can_be_switched_off() -> None:
    with engine(supports_multimodal=False, kv_events_port=None) as handle:
        c = Client(handle.target)
        try:
            info = c.control.GetModelInfo(control_pb2.GetModelInfoRequest(), timeout=5)
            assert not info.supports_multimodal
            item = inference_pb2.MediaItem(raw_bytes=png(28, 28))
            with pytest.raises(grpc.RpcError) as caught:
                c.stream(with_media([IMAGE], item))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            c.close()
