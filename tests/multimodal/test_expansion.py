"""Tokens per image: the Qwen2-VL rule, fixed-count families, and learning from vLLM."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.expansion import (
    FixedTokens,
    LearnedTokenCounts,
    QwenVLPatchMerge,
    formula_for,
)
from rankgate.multimodal.types import MediaConfig
from rankgate.sidecar.types import MediaInput

QWEN = QwenVLPatchMerge(14, 2, 56 * 56, 28 * 28 * 16384)
QWEN25_BUDGET = QwenVLPatchMerge(14, 2, 256 * 28 * 28, 1280 * 28 * 28)


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (1024, 1024, 37 * 37),  # 1024 rounds to 1036 = 37 * 28
        (28, 28, 4),  # under min_pixels: scaled up to 56x56
        (20, 20, 4),
        (640, 480, 23 * 17),  # 644 x 476
        (56, 5600, 2 * 200),  # aspect exactly 200 is still accepted
    ],
)
def test_qwen_known_sizes(width: int, height: int, tokens: int) -> None:
    assert QWEN.tokens(width, height) == tokens


def test_qwen_budget_caps_large_images() -> None:
    # 1024^2 rounds to 1036^2 > 1280 * 28^2, so it is scaled by sqrt(1024^2 / budget): 35x35.
    assert QWEN25_BUDGET.tokens(1024, 1024) == 35 * 35


# No deadline: the 2 shared CPUs make timing meaningless; the property is what is checked.
@settings(deadline=None, max_examples=300)
@given(st.integers(1, 4000), st.integers(1, 4000))
def test_qwen_sides_are_multiples_and_area_stays_in_budget(width: int, height: int) -> None:
    if max(width, height) / min(width, height) > 200:
        with pytest.raises(MediaRefused, match="aspect ratio"):
            QWEN25_BUDGET.tokens(width, height)
        return
    w_bar, h_bar = QWEN25_BUDGET.resized(width, height)
    assert w_bar % 28 == 0
    assert h_bar % 28 == 0
    assert w_bar * h_bar <= 1280 * 28 * 28 or min(w_bar, h_bar) == 28
    assert w_bar * h_bar >= 256 * 28 * 28
    assert QWEN25_BUDGET.tokens(width, height) == (w_bar // 28) * (h_bar // 28)


def test_fixed_family_ignores_size() -> None:
    assert FixedTokens(576).tokens(1, 1) == FixedTokens(576).tokens(4000, 3000) == 576


@pytest.mark.parametrize(
    ("model_id", "family", "tokens_1024"),
    [
        ("Qwen/Qwen2-VL-7B-Instruct", "qwen2_vl", 1369),
        ("Qwen/Qwen2.5-VL-3B-Instruct", "qwen2_vl", 1369),
        ("llava-hf/llava-1.5-7b-hf", "fixed", 576),
        ("liuhaotian/llava-v1.5-13b", "fixed", 576),
        ("tiny-llama", None, None),
    ],
)
def test_auto_family_from_model_id(
    model_id: str, family: str | None, tokens_1024: int | None
) -> None:
    formula = formula_for(MediaConfig(), model_id)
    assert (formula.name if formula else None) == family
    assert (formula.tokens(1024, 1024) if formula else None) == tokens_1024


def test_configured_family_wins_over_the_model_id() -> None:
    assert formula_for(MediaConfig(token_family="none"), "Qwen2-VL-2B") is None
    forced = formula_for(MediaConfig(token_family="llava_1_5", fixed_image_tokens=144), "x")
    assert forced is not None
    assert forced.tokens(5, 5) == 144


def media(*uuids: str, counts: dict[str, int] | None = None) -> list[MediaInput]:
    counts = counts or {}
    return [MediaInput(uuid=u, num_tokens=counts.get(u)) for u in uuids]


def test_learns_one_image_from_the_expanded_prompt_length() -> None:
    learned = LearnedTokenCounts(8)
    # 10 prompt tokens including 1 placeholder; vLLM counts 9 text + 64 image tokens.
    assert learned.observe(media("a"), prompt_len=10, expanded_prompt_tokens=73) == "a"
    assert learned.get("a") == 64


def test_learns_a_repeated_image_and_the_one_unknown_among_known() -> None:
    learned = LearnedTokenCounts(8)
    assert learned.observe(media("a", "a"), 12, 10 + 2 * 30) == "a"
    assert learned.get("a") == 30
    assert learned.observe(media("a", "b", counts={}), 12, 10 + 30 + 50) == "b"
    assert learned.get("b") == 50
    assert learned.observe(media("c", "d", counts={"c": 7}), 5, 3 + 7 + 9) == "d"
    assert learned.get("d") == 9


def test_ambiguous_or_inconsistent_observations_teach_nothing() -> None:
    learned = LearnedTokenCounts(8)
    assert learned.observe(media("x", "y"), 12, 100) is None
    assert learned.observe(media("x", "x"), 12, 10 + 31) is None  # odd total for two copies
    assert learned.observe(media("x"), 12, 5) is None
    assert learned.observe([], 12, 12) is None
    assert len(learned) == 0


def test_learned_counts_are_bounded() -> None:
    learned = LearnedTokenCounts(2)
    for uuid in "abc":
        learned.observe(media(uuid), 1, 10)
    assert (learned.get("a"), learned.get("c"), len(learned)) == (None, 10, 2)


P = 99  # a placeholder token id


def placed(uuid: str, position: int) -> MediaInput:
    return MediaInput(uuid=uuid, position=position, modality="video")


def test_an_expansion_that_is_not_a_run_is_learnt_exactly() -> None:
    """Qwen3-VL writes timestamps and markers among a video's frames: not one run."""
    learned = LearnedTokenCounts(16)
    learned.saw("v", (2, 64, 48, 8, 2000))
    prompt = [1, 2, P, 3, 4]
    expansion = (7, 8, P, P, 9, 8, P, P, 9)
    expanded = [1, 2, *expansion, 3, 4]
    assert learned.observe_runs([placed("v", 2)], len(prompt), expanded) == []
    assert learned.observe_expansions([placed("v", 2)], prompt, expanded) == ["v"]
    assert learned.expansion("v") == expansion
    assert learned.get("v") == len(expansion)
    # Another video of the same shape expands the same way.
    assert learned.expansion_for_shape((2, 64, 48, 8, 2000)) == expansion
    assert learned.for_shape((2, 64, 48, 8, 2000)) == len(expansion)


def test_two_expansions_are_told_apart_by_the_text_between_them() -> None:
    learned = LearnedTokenCounts(16)
    prompt = [1, P, 5, 6, P, 3]
    expanded = [1, 10, 11, 5, 6, 12, 13, 14, 3]
    media = [placed("a", 1), placed("b", 4)]
    assert learned.observe_expansions(media, prompt, expanded) == ["a", "b"]
    assert (learned.expansion("a"), learned.expansion("b")) == ((10, 11), (12, 13, 14))


@pytest.mark.parametrize(
    ("prompt", "expanded", "positions"),
    [
        ([1, P, P, 3], [1, 10, 11, 12, 3], [1, 2]),  # side by side: no text to split them
        ([1, P, 3], [2, 10, 3], [1]),  # the text before differs
        ([1, P, 3, 4], [1, 10, 11, 3], [1]),  # the text after differs
        ([1, P, 5, P, 3], [1, 10, 6, 11, 3], [1, 3]),  # the text between is not there
    ],
)
def test_prompts_that_do_not_line_up_teach_no_expansion(
    prompt: list[int], expanded: list[int], positions: list[int]
) -> None:
    learned = LearnedTokenCounts(16)
    media = [placed(f"m{i}", p) for i, p in enumerate(positions)]
    assert learned.observe_expansions(media, prompt, expanded) == []
    assert len(learned) == 0


def test_the_router_hashes_an_exact_expansion_as_vllm_stores_it() -> None:
    from rankgate.sidecar.routing.hashing import prompt_keys

    prompt = (1, 2, 3, P, 4)
    expansion = (7, P, P, 8, P, P)
    run = MediaInput(uuid="v", num_tokens=len(expansion), position=3)
    exact = MediaInput(uuid="v", num_tokens=len(expansion), position=3, expansion=expansion)
    by_run = prompt_keys(prompt, 3, media=[run], media_positions=[3])
    by_expansion = prompt_keys(prompt, 3, media=[exact], media_positions=[3])
    assert by_run.prompt_tokens == by_expansion.prompt_tokens == len(prompt) - 1 + len(expansion)
    assert by_run.hashes[0] == by_expansion.hashes[0]  # the text-only block
    assert by_run.hashes[1] != by_expansion.hashes[1]
