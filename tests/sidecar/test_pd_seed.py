"""Taking the seeded first token out of a decode's stream."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from rankgate.sidecar.pd_seed import after_seed, held_back, opening
from rankgate.sidecar.types import Delta, TokenLogprob


async def stream_of(*deltas: Delta) -> AsyncGenerator[Delta, None]:
    for delta in deltas:
        yield delta


async def trimmed(seeded: Delta, *deltas: Delta) -> tuple[list[Delta], list[tuple[int, int]]]:
    mismatches: list[tuple[int, int]] = []
    out = [
        delta
        async for delta in after_seed(
            stream_of(*deltas), seeded, lambda a, b: mismatches.append((a, b))
        )
    ]
    return out, mismatches


def logprob(token: int) -> TokenLogprob:
    return TokenLogprob(token_id=token, logprob=-0.5, rank=1)


SEEDED = Delta(text=" Hello", token_ids=(7,), logprobs=(logprob(7),), prompt_tokens=5)


async def test_a_first_delta_of_one_token_is_dropped() -> None:
    out, mismatches = await trimmed(
        SEEDED,
        Delta(text=" Hello", token_ids=(7,), prompt_tokens=5, route="rank=0"),
        Delta(text=" world", token_ids=(8,)),
        Delta(text="!", token_ids=(9,), finish_reason="length", completion_tokens=3),
    )
    assert [d.text for d in out] == [" world", "!"]
    assert out[-1].completion_tokens == 3
    assert mismatches == []


async def test_a_first_delta_of_several_tokens_keeps_the_rest() -> None:
    out, _ = await trimmed(
        SEEDED,
        Delta(
            text=" Hello world",
            token_ids=(7, 8),
            logprobs=(logprob(7), logprob(8)),
            prompt_tokens=5,
            route="rank=0",
            rank=0,
        ),
        Delta(finish_reason="stop", completion_tokens=2),
    )
    first = out[0]
    assert (first.text, first.token_ids, first.logprobs) == (" world", (8,), (logprob(8),))
    # What only a choice's first delta carries, the client had from the seeded one.
    assert (first.prompt_tokens, first.route, first.rank) == (None, None, None)


async def test_a_decode_that_ends_with_its_first_token_passes_its_finish() -> None:
    out, _ = await trimmed(
        SEEDED, Delta(text=" Hello", token_ids=(7,), finish_reason="stop", completion_tokens=1)
    )
    assert len(out) == 1
    assert (out[0].text, out[0].token_ids, out[0].finish_reason) == ("", (), "stop")


async def test_a_different_first_token_is_reported_and_the_stream_goes_on() -> None:
    out, mismatches = await trimmed(
        SEEDED, Delta(text=" Hi", token_ids=(4,)), Delta(text=" there", token_ids=(5,))
    )
    assert mismatches == [(7, 4)]
    assert [d.text for d in out] == [" Hi", " there"]


async def test_deltas_before_the_first_token_are_skipped() -> None:
    out, _ = await trimmed(
        SEEDED, Delta(prompt_tokens=5), Delta(text=" Hello", token_ids=(7,)), Delta(text=".")
    )
    assert [d.text for d in out] == ["."]


def test_a_token_ending_inside_a_character_is_held_back() -> None:
    assert held_back(Delta(text="\ufffd", token_ids=(200,)))
    assert held_back(Delta(text="ab\ufffd", token_ids=(201,)))
    assert not held_back(SEEDED)


def test_the_opening_carries_no_finish() -> None:
    prefilled = Delta(
        text=" Hello",
        token_ids=(7,),
        finish_reason="length",
        completion_tokens=1,
        kv_transfer_params={"do_remote_prefill": True},
    )
    first = opening(prefilled)
    assert (first.finish_reason, first.completion_tokens, first.kv_transfer_params) == (
        None,
        None,
        None,
    )
    assert first.token_ids == (7,)
