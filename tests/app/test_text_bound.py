"""The characters-per-token bound: sound where it is given, absent where it cannot be."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankgate.app.tokens.text_bound import chars_per_token_bound
from rankgate.app.tokens.tokenizer import TextTokenizer
from tests.conftest import TINY_TOKENIZER

TINY = TextTokenizer(TINY_TOKENIZER)
SPEC: dict[str, Any] = orjson.loads((TINY_TOKENIZER / "tokenizer.json").read_bytes())


@settings(derandomize=True, deadline=None, database=None, max_examples=200,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(text=st.text(max_size=400) | st.sampled_from([" " * 500, "a" * 500, "\n" * 300, "é" * 99]))
def test_no_text_has_fewer_tokens_than_the_bound_promises(text: str) -> None:
    bound = TINY.max_chars_per_token
    assert bound is not None
    tokens = len(TINY.encode(text, add_special_tokens=False))
    assert tokens * bound >= len(text)
    assert not TINY.surely_exceeds(text, tokens)


def with_parts(**parts: Any) -> dict[str, Any]:
    return {**SPEC, **parts}


def test_pipelines_that_can_shorten_text_have_no_bound() -> None:
    model = SPEC["model"]
    assert chars_per_token_bound(SPEC) is not None
    for unbounded in (
        with_parts(model={"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "[UNK]"}),
        with_parts(model={"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "[UNK]"}),
        with_parts(model={"type": "Unigram", "vocab": [["a", 0.0]]}),
        with_parts(model={**model, "unk_token": "<unk>", "fuse_unk": True}),
        with_parts(normalizer={"type": "Strip", "strip_left": True, "strip_right": True}),
        with_parts(normalizer={"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}),
        with_parts(normalizer={"type": "Replace", "pattern": {"String": "ab"}, "content": ""}),
        with_parts(normalizer={"type": "Precompiled", "precompiled_charsmap": ""}),
        with_parts(pre_tokenizer={"type": "WhitespaceSplit"}),
        with_parts(
            pre_tokenizer={"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}
        ),
    ):
        assert chars_per_token_bound(unbounded) is None, unbounded


def test_shortening_normalizers_widen_the_bound() -> None:
    plain = chars_per_token_bound(SPEC)
    assert plain is not None
    nfc = chars_per_token_bound(with_parts(normalizer={"type": "NFC"}))
    assert nfc == 3 * plain
    replace = {"type": "Replace", "pattern": {"String": "abcd"}, "content": "x"}
    both = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, replace]}
    assert chars_per_token_bound(with_parts(normalizer=both)) == 12 * plain
    long_added = with_parts(added_tokens=[{"id": 9, "content": "x" * 500}])
    assert chars_per_token_bound(long_added) == 500
