"""Audio and video, the same facts on the mock engine and on real vLLM.

The audio model is a tiny Qwen3-ASR, the video model a tiny Qwen3-VL; the mock plays each with
a mock of that one modality. One placeholder in ``token_ids`` becomes the item's expansion in
vLLM's ``PromptInfo`` with the text around it unchanged (an audio clip's a run of its
placeholder; a Qwen3-VL video's frames come with timestamps and markers, the mock's as a
run), each stored block the item touches names its uuid in its KV event, the same bytes under
another uuid are other blocks, and a modality the model does not take is INVALID_ARGUMENT.
The counts are each engine's own.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest

from rankgate.mocker.config import MockEngineConfig
from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance import helpers
from tests.conftest import CONFORMANCE_BLOCK, CONFORMANCE_DP, TINY_TOKENIZER
from tests.multimodal.clips import video, wav
from tests.multimodal.pictures import encode, noise
from tests.support.engines import EngineUnderTest
from tests.support.mock_engine import running_mock_engine
from tests.support.ports import free_port, free_port_range
from tests.support.real_vllm import RealVllm

AUDIO_TOKEN_ID = 3072  # <|audio|> in the mock's tokenizer, <|audio_pad|> in the Qwen3-ASR's
VIDEO_TOKEN_ID = 3073  # <|video|> in the mock's, <|video_pad|> in the Qwen3-VL's
# Qwen3-VL finds a video between its vision start and end markers (<|bos|> and <|pad|> in the
# tiny vocabulary); the mock ignores them.
VISION_START, VISION_END = 0, 2
BEFORE, AFTER = 30, 40


def _mock(modalities: tuple[str, ...]) -> Iterator[EngineUnderTest]:
    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=CONFORMANCE_DP,
        block_size=CONFORMANCE_BLOCK,
        model="tiny-llama",
        tokenizer=str(TINY_TOKENIZER),
        kv_events_port=free_port_range(CONFORMANCE_DP),
        kv_replay_port=free_port_range(CONFORMANCE_DP),
        speed=0.0,
        max_model_len=2048,
        modalities=modalities,
    )
    with running_mock_engine(config) as handle:
        yield EngineUnderTest(
            kind="mock",
            target=handle.target,
            dp_size=config.dp_size,
            block_size=config.block_size,
            served_model_name=config.model,
            tokenizer_dir=TINY_TOKENIZER,
            kv_events_base_port=config.kv_events_port,
            kv_replay_base_port=config.kv_replay_port,
        )


def _real(server: RealVllm) -> EngineUnderTest:
    return EngineUnderTest(
        kind="real",
        target=server.target,
        dp_size=server.dp_size,
        block_size=server.block_size,
        served_model_name=server.served_model_name,
        tokenizer_dir=server.model_dir,
        kv_events_base_port=server.kv_events_base_port,
        kv_replay_base_port=server.kv_replay_base_port,
    )


ENGINES = ["mock", pytest.param("real", marks=pytest.mark.real_vllm)]


@pytest.fixture(scope="module", params=ENGINES)
def audio_engine(request: pytest.FixtureRequest) -> Iterator[EngineUnderTest]:
    if request.param == "mock":
        yield from _mock(("audio",))
    else:
        yield _real(request.getfixturevalue("real_asr"))


@pytest.fixture(scope="module", params=ENGINES)
def video_engine(request: pytest.FixtureRequest) -> Iterator[EngineUnderTest]:
    if request.param == "mock":
        yield from _mock(("image", "video"))
    else:
        yield _real(request.getfixturevalue("real_vl"))


def clip_request(
    modality: int, data: bytes, mime: str, item_id: str, around: tuple[int, ...] = ()
) -> inference_pb2.GenerateRequest:
    token = AUDIO_TOKEN_ID if modality == inference_pb2.MODALITY_AUDIO else VIDEO_TOKEN_ID
    placeholder = [around[0], token, around[1]] if around else [token]
    ids = [*helpers.fresh_prompt(BEFORE), *placeholder, *helpers.fresh_prompt(AFTER)]
    request = helpers.make_request(
        ids,
        tag="clip",
        max_new_tokens=1,
        response=inference_pb2.ResponseOptions(prompt_token_ids=True, output_token_ids=True),
    )
    request.media.add(modality=modality, raw_bytes=data, mime_type=mime, uuid=item_id)
    return request


def audio_request(data: bytes, item_id: str) -> inference_pb2.GenerateRequest:
    return clip_request(inference_pb2.MODALITY_AUDIO, data, "audio/wav", item_id)


def video_request(data: bytes, item_id: str) -> inference_pb2.GenerateRequest:
    return clip_request(
        inference_pb2.MODALITY_VIDEO, data, "video/mp4", item_id, (VISION_START, VISION_END)
    )


def fresh_id() -> str:
    return uuid.uuid4().hex * 2


def expansion_of(
    channel: grpc.Channel, request: inference_pb2.GenerateRequest, token: int
) -> list[int]:
    """The placeholder's expansion in vLLM's prompt, after checking the text around it."""
    ids = list(request.token_ids.ids)
    info = helpers.stream(channel, request, rank=0).messages[0].prompt_info
    expanded = list(info.token_ids)
    assert len(expanded) == info.num_prompt_tokens
    at = ids.index(token)
    size = info.num_prompt_tokens - (len(ids) - 1)
    assert expanded[:at] == ids[:at]
    assert expanded[at + size :] == ids[at + 1 :]
    return expanded[at : at + size]


def test_an_audio_placeholder_becomes_one_run(audio_engine: EngineUnderTest) -> None:
    with grpc.insecure_channel(audio_engine.target) as channel:
        expansion = expansion_of(channel, audio_request(wav(2.0), fresh_id()), AUDIO_TOKEN_ID)
    assert len(expansion) > 1
    assert set(expansion) == {AUDIO_TOKEN_ID}


def test_a_longer_clip_expands_to_more_tokens(audio_engine: EngineUnderTest) -> None:
    with grpc.insecure_channel(audio_engine.target) as channel:
        short = expansion_of(channel, audio_request(wav(1.0), fresh_id()), AUDIO_TOKEN_ID)
        long = expansion_of(channel, audio_request(wav(3.0), fresh_id()), AUDIO_TOKEN_ID)
    assert len(long) > len(short)


def test_a_video_placeholder_expands_in_place(video_engine: EngineUnderTest) -> None:
    clip = video(frames=8, width=64, height=48, fps=4)
    with grpc.insecure_channel(video_engine.target) as channel:
        expansion = expansion_of(channel, video_request(clip, fresh_id()), VIDEO_TOKEN_ID)
    assert expansion.count(VIDEO_TOKEN_ID) > 1


def test_audio_blocks_name_the_uuid_and_other_uuids_are_other_blocks(
    audio_engine: EngineUnderTest,
) -> None:
    blocks_name_their_uuid(audio_engine, audio_request, wav(2.0, tone=350.0))


def test_video_blocks_name_the_uuid_and_other_uuids_are_other_blocks(
    video_engine: EngineUnderTest,
) -> None:
    blocks_name_their_uuid(video_engine, video_request, video(frames=8, shade=3))


def blocks_name_their_uuid(
    engine: EngineUnderTest,
    build: Callable[[bytes, str], inference_pb2.GenerateRequest],
    data: bytes,
) -> None:
    first = build(data, fresh_id())
    second = build(data, fresh_id())
    second.token_ids.ids[:] = first.token_ids.ids
    with grpc.insecure_channel(engine.target) as channel, helpers.kv_listener(engine) as events:
        helpers.stream(channel, first, rank=0)
        helpers.stream(channel, second, rank=0)

        def named(found: list[helpers.KvEvent], item_id: str) -> set[object]:
            return {
                event.block_hashes[index]
                for event in found
                if event.kind == "BlockStored"
                for index, keys in enumerate(event.extra_keys or ())
                for key in keys or ()
                if isinstance(key, list) and key[0] == item_id
            }

        seen = events.wait_for(
            lambda found: (
                bool(named(found, first.media[0].uuid)) and bool(named(found, second.media[0].uuid))
            )
        )
    assert named(seen, first.media[0].uuid).isdisjoint(named(seen, second.media[0].uuid))


def test_an_audio_model_refuses_an_image(audio_engine: EngineUnderTest) -> None:
    request = helpers.make_request([*helpers.fresh_prompt(8), 5, 40], tag="image", max_new_tokens=1)
    request.media.add(
        modality=inference_pb2.MODALITY_IMAGE,
        raw_bytes=encode(noise(32, 32, seed=4), "PNG"),
        mime_type="image/png",
        uuid=fresh_id(),
    )
    with (
        grpc.insecure_channel(audio_engine.target) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        helpers.stream(channel, request, rank=0)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_video_model_refuses_audio(video_engine: EngineUnderTest) -> None:
    request = audio_request(wav(1.0), fresh_id())
    with (
        grpc.insecure_channel(video_engine.target) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        helpers.stream(channel, request, rank=0)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
