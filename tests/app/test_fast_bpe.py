"""tiktoken encodes plain text for byte-level BPE tokenizers only where it gives the same ids."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rankgate.app.tokens.fast_bpe import candidate
from rankgate.app.tokens.tokenizer import TextTokenizer, _bytes_decoder
from tests.app.test_text_split import text_of
from tests.conftest import TINY_TOKENIZER

BYTES = _bytes_decoder()


def _tiny_spec() -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((TINY_TOKENIZER / "tokenizer.json").read_text())
    return spec


def _encode_many(tokenizer: Tokenizer) -> Any:
    def many(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    return many


@pytest.fixture(scope="module")
def tiny() -> TextTokenizer:
    tokenizer = TextTokenizer(TINY_TOKENIZER)
    assert tokenizer.fast_checked.wait(60)
    return tokenizer


def test_the_tiny_byte_level_bpe_is_encoded_with_tiktoken(tiny: TextTokenizer) -> None:
    assert tiny.fast


@pytest.mark.parametrize("seed", range(6))
def test_prompts_get_the_ids_tokenizers_gives(tiny: TextTokenizer, seed: int) -> None:
    whole = Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
    text = text_of(random.Random(seed), 2_000 + 10_000 * seed)
    marked = f"<|im_start|>system\n{text}<|im_end|>\n<|im_start|>user\n{text[:500]}<|im_end|>"
    for sample in (text, marked, "", " ", "\n\n", "😀" * 50, "x" * 5000):
        assert tiny.encode(sample, False) == whole.encode(sample, add_special_tokens=False).ids


def _trained() -> dict[str, Any]:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text_of(random.Random(i), 3000) for i in range(20)], trainer)
    spec: dict[str, Any] = json.loads(tokenizer.to_str())
    return spec


def test_a_trained_byte_level_bpe_agrees() -> None:
    spec = _trained()
    fast = candidate(spec, BYTES)
    assert fast is not None
    assert fast.agrees(_encode_many(Tokenizer.from_str(json.dumps(spec))))


def test_a_vocabulary_token_no_merge_reaches_fails_the_check() -> None:
    # tiktoken takes a piece that is a vocabulary token whole; tokenizers reaches tokens only
    # through merges, and no merge makes this one.
    spec = _trained()
    vocab = spec["model"]["vocab"]
    vocab["Ġxyzzyq"] = len(vocab)
    fast = candidate(spec, BYTES)
    assert fast is not None
    assert not fast.agrees(_encode_many(Tokenizer.from_str(json.dumps(spec))))


def _swap_merges(spec: dict[str, Any]) -> None:
    merges = spec["model"]["merges"]
    merges[10], merges[11] = merges[11], merges[10]


def _drop_byte(spec: dict[str, Any]) -> None:
    vocab = spec["model"]["vocab"]
    del vocab[next(token for token in vocab if len(token) == 1 and token not in "abc")]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s: s.update(normalizer={"type": "NFC"}), id="normalizer"),
        pytest.param(
            lambda s: s.update(pre_tokenizer={"type": "Metaspace", "prepend_scheme": "always"}),
            id="metaspace",
        ),
        pytest.param(lambda s: s["pre_tokenizer"].update(add_prefix_space=True), id="prefix-space"),
        pytest.param(lambda s: s["model"].update(byte_fallback=True), id="byte-fallback"),
        pytest.param(lambda s: s["model"].update(dropout=0.1), id="dropout"),
        pytest.param(lambda s: s.update(decoder={"type": "Metaspace"}), id="decoder"),
        pytest.param(_swap_merges, id="merges-out-of-vocabulary-order"),
        pytest.param(_drop_byte, id="a-byte-missing"),
    ],
)
def test_components_tiktoken_does_not_reproduce_are_refused(change: Any) -> None:
    spec = copy.deepcopy(_trained())
    assert candidate(spec, BYTES) is not None
    change(spec)
    assert candidate(spec, BYTES) is None


def test_a_split_pattern_before_byte_level_mapping_is_taken_as_its_regex() -> None:
    spec = _trained()
    pattern = (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
        ],
    }
    fast = candidate(spec, BYTES)
    assert fast is not None
    assert fast.agrees(_encode_many(Tokenizer.from_str(json.dumps(spec))))


def test_a_tokenizer_loaded_again_reuses_the_checked_encoder(tiny: TextTokenizer) -> None:
    assert tiny.fast
    again = TextTokenizer(TINY_TOKENIZER)
    # No second check: the verdict for the same file is known, and taken at once.
    assert again.fast_checked.is_set()
    assert again.fast
