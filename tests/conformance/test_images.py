"""Images, the same facts on the mock engine and on real vLLM (the tiny LLaVA).

One placeholder token per image in ``token_ids`` becomes a run of that token in vLLM's
expanded prompt (``PromptInfo``), and each stored block the image touches names it in its KV
event as ``[uuid, offset of the image's first token from the block's start]``, negative once
the image began in an earlier block. The image's size in tokens is each engine's own (the mock
counts 28-pixel patches, the tiny LLaVA 64 a picture); the layout around it is the same.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pytest

from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance import helpers
from tests.multimodal.pictures import encode, noise
from tests.support.engines import EngineUnderTest

IMAGE_TOKEN_ID = 5  # the placeholder of both: <|image|> in the mock, <image> in the LLaVA
BEFORE, AFTER = 30, 40  # text tokens around the image


@pytest.fixture(scope="module", params=["mock", pytest.param("real", marks=pytest.mark.real_vllm)])
def image_engine(request: pytest.FixtureRequest) -> EngineUnderTest:
    if request.param == "mock":
        mock: EngineUnderTest = request.getfixturevalue("mock_vllm")
        return mock
    real = request.getfixturevalue("real_llava")
    return EngineUnderTest(
        kind="real",
        target=real.target,
        dp_size=real.dp_size,
        block_size=real.block_size,
        served_model_name=real.served_model_name,
        tokenizer_dir=real.model_dir,
        kv_events_base_port=real.kv_events_base_port,
        kv_replay_base_port=real.kv_replay_base_port,
    )


@pytest.fixture(scope="module")
def channel(image_engine: EngineUnderTest) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(image_engine.target) as opened:
        yield opened


def image_request(picture: bytes, image_id: str) -> inference_pb2.GenerateRequest:
    ids = [*helpers.fresh_prompt(BEFORE), IMAGE_TOKEN_ID, *helpers.fresh_prompt(AFTER)]
    request = helpers.make_request(
        ids,
        tag="image",
        max_new_tokens=1,
        response=inference_pb2.ResponseOptions(prompt_token_ids=True, output_token_ids=True),
    )
    request.media.add(
        modality=inference_pb2.MODALITY_IMAGE,
        raw_bytes=picture,
        mime_type="image/png",
        uuid=image_id,
    )
    return request


def test_the_placeholder_becomes_one_run_and_the_count_includes_it(
    channel: grpc.Channel,
) -> None:
    request = image_request(encode(noise(112, 112, seed=1), "PNG"), uuid.uuid4().hex * 2)
    ids = list(request.token_ids.ids)
    info = helpers.stream(channel, request, rank=0).messages[0].prompt_info
    expanded = list(info.token_ids)
    run = info.num_prompt_tokens - (len(ids) - 1)
    assert run > 1
    assert len(expanded) == info.num_prompt_tokens
    assert expanded[:BEFORE] == ids[:BEFORE]
    assert expanded[BEFORE : BEFORE + run] == [IMAGE_TOKEN_ID] * run
    assert expanded[BEFORE + run :] == ids[BEFORE + 1 :]


def test_image_blocks_name_the_uuid_with_offsets_from_the_block_start(
    channel: grpc.Channel, image_engine: EngineUnderTest
) -> None:
    image_id = uuid.uuid4().hex * 2
    request = image_request(encode(noise(112, 112, seed=2), "PNG"), image_id)
    with helpers.kv_listener(image_engine) as events:
        info = helpers.stream(channel, request, rank=0).messages[0].prompt_info
        run = info.num_prompt_tokens - (len(request.token_ids.ids) - 1)
        block = image_engine.block_size
        full = info.num_prompt_tokens // block
        touched = [b for b in range(full) if b * block < BEFORE + run and (b + 1) * block > BEFORE]

        def offsets(found: list[helpers.KvEvent]) -> list[int]:
            return sorted(
                key[1]
                for event in found
                if event.kind == "BlockStored" and event.port_rank == 0
                for keys in event.extra_keys or ()
                for key in keys or ()
                if isinstance(key, list) and key[0] == image_id
            )

        seen = events.wait_for(lambda found: len(offsets(found)) >= len(touched))
    assert offsets(seen) == sorted(BEFORE - b * block for b in touched)
    assert min(offsets(seen)) < 0


def test_the_same_bytes_under_another_uuid_are_other_blocks(
    channel: grpc.Channel, image_engine: EngineUnderTest
) -> None:
    picture = encode(noise(112, 112, seed=3), "PNG")
    first = image_request(picture, uuid.uuid4().hex * 2)
    second = image_request(picture, uuid.uuid4().hex * 2)
    second.token_ids.ids[:] = first.token_ids.ids
    with helpers.kv_listener(image_engine) as events:
        helpers.stream(channel, first, rank=0)
        helpers.stream(channel, second, rank=0)

        def named(found: list[helpers.KvEvent], image_id: str) -> set[object]:
            return {
                event.block_hashes[index]
                for event in found
                if event.kind == "BlockStored"
                for index, keys in enumerate(event.extra_keys or ())
                for key in keys or ()
                if isinstance(key, list) and key[0] == image_id
            }

        seen = events.wait_for(
            lambda found: (
                bool(named(found, first.media[0].uuid)) and bool(named(found, second.media[0].uuid))
            )
        )
    assert named(seen, first.media[0].uuid).isdisjoint(named(seen, second.media[0].uuid))
