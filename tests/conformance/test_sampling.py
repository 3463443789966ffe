"""Each sampling knob's observable effect on the tokens that come back."""

from __future__ import annotations

import grpc
import pytest

from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance.helpers import make_request, prompt_ids, stream

pytestmark = pytest.mark.timeout(120)

NEW_TOKENS = 8


def tokens(
    channel: grpc.Channel,
    tag: str,
    *,
    temperature: float | None,
    rank: int = 0,
    sampling: inference_pb2.RandomSampling | None = None,
    priority: int = 0,
) -> list[int]:
    request = make_request(
        prompt_ids(tag, 12),
        tag=tag,
        temperature=temperature,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True),
        sampling=sampling,
        priority=priority,
    )
    result = stream(channel, request, rank=rank)
    assert len(result.token_ids) == NEW_TOKENS
    return result.token_ids


def seeded(seed: int, top_k: int = 0, top_p: float = 0.0) -> inference_pb2.RandomSampling:
    return inference_pb2.RandomSampling(seed=seed, top_k=top_k, top_p=top_p)


def test_temperature_zero_is_deterministic_on_every_rank(engine_channel: grpc.Channel) -> None:
    first = tokens(engine_channel, "greedy", temperature=0.0, rank=0)
    again = tokens(engine_channel, "greedy", temperature=0.0, rank=0)
    other_rank = tokens(engine_channel, "greedy", temperature=0.0, rank=1)
    assert first == again == other_rank


def test_missing_temperature_means_greedy(engine_channel: grpc.Channel) -> None:
    greedy = tokens(engine_channel, "no-temperature", temperature=0.0)
    absent = tokens(engine_channel, "no-temperature", temperature=None, sampling=seeded(3))
    assert absent == greedy


def test_different_seeds_differ(engine_channel: grpc.Channel) -> None:
    one = tokens(engine_channel, "seeds", temperature=1.0, sampling=seeded(1))
    two = tokens(engine_channel, "seeds", temperature=1.0, sampling=seeded(2))
    assert one != two


def test_same_seed_repeats_on_every_rank(engine_channel: grpc.Channel) -> None:
    first = tokens(engine_channel, "same-seed", temperature=1.0, sampling=seeded(11), rank=0)
    again = tokens(engine_channel, "same-seed", temperature=1.0, sampling=seeded(11), rank=0)
    other_rank = tokens(engine_channel, "same-seed", temperature=1.0, sampling=seeded(11), rank=1)
    assert first == again == other_rank


def test_sampling_without_limits_leaves_greedy(engine_channel: grpc.Channel) -> None:
    """The control for the top_k/top_p checks: this seed alone does not reproduce greedy."""
    greedy = tokens(engine_channel, "limits", temperature=0.0)
    free = tokens(engine_channel, "limits", temperature=1.0, sampling=seeded(5))
    assert free != greedy


def test_top_k_one_is_greedy(engine_channel: grpc.Channel) -> None:
    greedy = tokens(engine_channel, "limits", temperature=0.0)
    top_k = tokens(engine_channel, "limits", temperature=1.0, sampling=seeded(5, top_k=1))
    assert top_k == greedy


def test_tiny_top_p_is_greedy(engine_channel: grpc.Channel) -> None:
    greedy = tokens(engine_channel, "limits", temperature=0.0)
    top_p = tokens(engine_channel, "limits", temperature=1.0, sampling=seeded(5, top_p=1e-6))
    assert top_p == greedy


@pytest.mark.parametrize("priority", [5, -3])
def test_priority_is_accepted(engine_channel: grpc.Channel, priority: int) -> None:
    """Nonzero priority is accepted (vLLM's default FCFS scheduler ignores it), output unchanged."""
    plain = tokens(engine_channel, "priority", temperature=0.0)
    assert tokens(engine_channel, "priority", temperature=0.0, priority=priority) == plain
