"""bench/node_engine.mjs speaks the parts of vLLM's gRPC contract a gateway uses, and a gateway
in front of it answers.

The equal-load figures in front of it are only worth something if both gateways take it for a
vLLM engine: the topology they discover, token ids and text they relay, and exactly the
number of tokens asked for, paced one a step with the prompt's size first and the finish last.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from rankgate.wire.proto.vllm import (
    control_pb2,
    control_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import peers  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[peers.Engine]:
    with ExitStack() as stack:
        yield peers.start_node_engine(
            stack, tmp_path_factory.mktemp("node-engine"), paced_step_seconds=0.002
        )


@pytest.fixture
def channel(engine: peers.Engine) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(engine.target) as channel:
        yield channel


def _control(channel: grpc.Channel) -> Any:
    return control_pb2_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]


def _inference(channel: grpc.Channel) -> Any:
    return inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]


def test_control_describes_the_engine(engine: peers.Engine, channel: grpc.Channel) -> None:
    control = _control(channel)
    info = control.GetServerInfo(control_pb2.GetServerInfoRequest(), timeout=5)
    assert info.parallelism.data_parallel_size == 2
    assert info.parallelism.data_parallel_size_local == 2
    assert info.kv_block_size == engine.block_size
    model = control.GetModelInfo(control_pb2.GetModelInfoRequest(), timeout=5)
    assert model.served_model_name == engine.model
    assert model.supports_token_ids_input
    sources = control.GetKvEventSources(control_pb2.GetKvEventSourcesRequest(), timeout=5)
    assert [s.endpoint for s in sources.sources] == engine.kv_endpoints
    assert [s.data_parallel_rank for s in sources.sources] == [0, 1]


def _request(tokens: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        request_id="r1",
        token_ids=inference_pb2.TokenIds(ids=[5, 300, 70000, 9]),
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=tokens),
    )


def test_generate_answers_the_tokens_asked_for(channel: grpc.Channel) -> None:
    reply = _inference(channel).Generate(_request(5), timeout=5)
    assert reply.prompt_info.num_prompt_tokens == 4
    assert reply.outputs.num_tokens == 5
    assert len(set(reply.outputs.token_ids)) == 1
    assert len(reply.outputs.token_ids) == 5
    assert reply.outputs.finish_info.finish_reason == inference_pb2.FinishInfo.LENGTH
    assert reply.outputs.finish_info.num_output_tokens == 5


def test_a_stream_carries_one_token_a_message(channel: grpc.Channel) -> None:
    messages = list(_inference(channel).GenerateStream(_request(6), timeout=5))
    assert len(messages) == 6
    assert [m.HasField("prompt_info") for m in messages] == [True] + [False] * 5
    assert messages[0].prompt_info.num_prompt_tokens == 4
    assert [len(m.outputs.token_ids) for m in messages] == [1] * 6
    assert [m.outputs.HasField("finish_info") for m in messages] == [False] * 5 + [True]
    assert messages[-1].outputs.finish_info.num_output_tokens == 6
    assert len({m.outputs.text for m in messages}) == 1


def test_an_unknown_method_is_unimplemented(channel: grpc.Channel) -> None:
    control = _control(channel)
    with pytest.raises(grpc.RpcError) as failed:
        control.IsSleeping(control_pb2.IsSleepingRequest(), timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_rankgate_serves_chat_in_front_of_it(engine: peers.Engine) -> None:
    with ExitStack() as stack:
        gateway = peers.start_rankgate(stack, engine)
        body = {
            "model": engine.model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3,
        }
        reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["usage"]["completion_tokens"] == 3
        assert answer["choices"][0]["finish_reason"] == "length"
        with httpx.stream(
            "POST",
            f"{gateway.url}/v1/chat/completions",
            json={**body, "stream": True},
            timeout=10,
        ) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        # Tokens that arrive together may share a chunk (as vLLM merges what a slow reader
        # has not taken yet), so the stream is checked by what it says, not its chunk count.
        choices = [c for e in events[:-1] for c in json.loads(e[6:])["choices"]]
        streamed = "".join(c["delta"].get("content") or "" for c in choices)
        assert streamed == answer["choices"][0]["message"]["content"]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
