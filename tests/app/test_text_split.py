"""Long texts cut at word spaces encode to exactly the ids of the whole text, or are not cut."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from rankgate.app.tokens.text_split import TextSplitter, pieces, splittable
from rankgate.app.tokens.tokenizer import LONG_TEXT_CHARS, TextTokenizer
from tests.conftest import TINY_TOKENIZER

WORDS = (
    "the", "router", "sends", "each", "prompt", "to", "rank", "12345", "3.14", "it's", "café",
    "東京", "😀", "(a)", "x=1;", "\n", "\t", "  ", "\n\n", "---", "CamelCase", "snake_case",
)  # fmt: skip


def text_of(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


@pytest.mark.parametrize("size", [1, 7, 64, 4096])
def test_pieces_join_to_the_text_and_cut_only_before_a_space_between_words(size: int) -> None:
    text = text_of(random.Random(size), 20_000)
    cut = pieces(text, size)
    assert "".join(cut) == text
    assert all(len(part) >= size for part in cut[:-1])
    position = 0
    for part in cut[:-1]:
        position += len(part)
        assert text[position] == " "
        assert not text[position - 1].isspace()
        assert not text[position + 1].isspace()


def test_a_text_without_a_word_space_stays_whole() -> None:
    assert pieces("x" * 10_000, 16) == ["x" * 10_000]
    assert pieces("a  b\n c", 1) == ["a  b\n c"]


@pytest.mark.parametrize("seed", range(8))
def test_long_texts_encode_to_the_whole_texts_ids(seed: int) -> None:
    tokenizer = TextTokenizer(TINY_TOKENIZER)
    whole = Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
    assert tokenizer._splitter is not None
    text = text_of(random.Random(seed), 3 * LONG_TEXT_CHARS + seed * 1000)
    expected = whole.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    # With the chat markers in it (the segment encoder's pieces are cut as well).
    marked = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(marked, False) == whole.encode(marked, add_special_tokens=False).ids


def _trained(pre_tokenizer: pre_tokenizers.PreTokenizer) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizer
    corpus = [text_of(random.Random(i), 2000) for i in range(20)]
    tokenizer.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"], show_progress=False)
    )
    return tokenizer


def test_a_pattern_that_keeps_spaces_with_the_word_before_fails_the_check() -> None:
    # Pre-tokens "word " end in their space: a cut before it moves the space to the next one.
    split = pre_tokenizers.Split(r"\S+\s*", behavior="isolated")
    tokenizer = _trained(split)
    spec = {"pre_tokenizer": {"type": "Split"}, "normalizer": None}
    assert splittable(spec)

    def many(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def whole(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    assert not TextSplitter(many).agrees(whole)
    # The byte-level pattern passes the same check.
    byte_level = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))

    def many_bl(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in byte_level.encode_batch_fast(texts, add_special_tokens=False)]

    def whole_bl(text: str) -> list[int]:
        ids: list[int] = byte_level.encode(text, add_special_tokens=False).ids
        return ids

    assert TextSplitter(many_bl).agrees(whole_bl)


@pytest.mark.parametrize(
    "spec",
    [
        {"pre_tokenizer": None},
        {"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "always"}},
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}},
        {"pre_tokenizer": {"type": "Whitespace"}, "normalizer": {"type": "Prepend"}},
        {"pre_tokenizer": {"type": "Whitespace"}, "normalizer": {"type": "Strip"}},
        {"pre_tokenizer": {"type": "Digits"}},
    ],
)
def test_components_that_could_join_words_across_a_space_are_not_cut(spec: dict[str, Any]) -> None:
    assert not splittable(spec)
