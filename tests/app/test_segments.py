"""Piecewise prompt encoding equals whole-text encoding, and its piece cache stays bounded."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.app.tokens import segments
from rankgate.app.tokens.segments import SegmentEncoder, segmentable
from rankgate.app.tokens.tokenizer import LONG_TEXT_CHARS, TextTokenizer
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.large_vocab import added_token_texts, write_large_vocab_tokenizer

_RAW = Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
_ADDED = [
    str(t["content"])
    for t in json.loads((TINY_TOKENIZER / "tokenizer.json").read_text())["added_tokens"]
]
_TINY = TextTokenizer(TINY_TOKENIZER)
_WORDS = [
    "hello",
    " world",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "ü",
    "東京",
    "😀",
    "12",
    "345",
    "!?",
    "<",
    ">",
]
_TEXTS = st.lists(st.sampled_from(_WORDS + _ADDED) | st.text(max_size=6), max_size=24).map("".join)


def _whole(tokenizer: Tokenizer, text: str, special: bool = False) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=special).ids
    return ids


def test_the_tiny_tokenizer_is_encoded_piecewise() -> None:
    assert _TINY.segmented


def test_a_long_prompt_is_served_from_its_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the length that is encoded with the GIL released, a repeated system prompt is
    still encoded once: only the new turn reaches the library."""
    tokenizer = TextTokenizer(TINY_TOKENIZER)
    system = "Answer in the voice of a patient teacher. " * 400
    assert len(system) > LONG_TEXT_CHARS
    # The path tokenizers takes (tiktoken, once checked, is tests/app/test_fast_bpe.py's).
    assert tokenizer.fast_checked.wait(60)
    tokenizer._fast = None
    encoded: list[int] = []
    splitter = tokenizer._splitter
    assert splitter is not None
    pieces = splitter._encode_many

    def counted(texts: list[str]) -> list[list[int]]:
        encoded.extend(len(text) for text in texts)
        return pieces(texts)

    monkeypatch.setattr(splitter, "_encode_many", counted)
    for turn in range(3):
        text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nturn {turn}"
        assert tokenizer.encode(text, False) == _whole(_RAW, text)
    # Once, in pieces cut at word spaces.
    assert sum(encoded) == len("system\n" + system)
    assert len(encoded) > 1


@settings(max_examples=300, deadline=None)
@given(_TEXTS)
def test_piecewise_ids_equal_whole_text_ids(text: str) -> None:
    assert _TINY.encode(text, False) == _whole(_RAW, text)
    # Twice: the second answer comes from the cached pieces.
    assert _TINY.encode(text, False) == _whole(_RAW, text)
    assert _TINY.encode(text, True) == _whole(_RAW, text, True)


def test_pieces_are_encoded_once() -> None:
    calls: list[str] = []

    def encode(piece: str) -> list[int]:
        calls.append(piece)
        return _whole(_RAW, piece)

    encoder = SegmentEncoder(encode, {"<|im_start|>": 3, "<|im_end|>": 4})
    system = "<|im_start|>system\nBe brief.<|im_end|>\n"
    first = encoder.encode(system + "<|im_start|>user\nHi<|im_end|>\n")
    second = encoder.encode(system + "<|im_start|>user\nBye<|im_end|>\n")
    assert calls == ["system\nBe brief.", "\n", "user\nHi", "user\nBye"]
    assert first == _whole(_RAW, system + "<|im_start|>user\nHi<|im_end|>\n")
    assert second == _whole(_RAW, system + "<|im_start|>user\nBye<|im_end|>\n")


def test_the_piece_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "MAX_PIECES", 8)
    monkeypatch.setattr(segments, "MAX_CACHED_BYTES", 4000)
    encoder = SegmentEncoder(lambda piece: _whole(_RAW, piece), {"<|im_end|>": 4})
    for i in range(100):
        text = f"message number {i} says hi<|im_end|>" + "x y " * (i % 30)
        assert encoder.encode(text) == _whole(_RAW, text)
        assert encoder.size <= 8
        assert 0 < encoder.cached_bytes <= 4000
    # Charged at its size in memory: the text, and an int object and a pointer per id.
    kept = "word " * 5
    encoder.encode(kept)
    assert kept in encoder
    assert encoder.cached_bytes >= sys.getsizeof(kept) + 36 * len(_whole(_RAW, kept))
    # A piece over a quarter of the budget is encoded, not kept, and evicts nothing.
    size = encoder.size
    huge = "word " * 100
    assert encoder.encode(huge) == _whole(_RAW, huge)
    assert huge not in encoder
    assert kept in encoder
    assert encoder.size == size


def test_a_long_piece_is_encoded_once() -> None:
    """A long system prompt repeats across requests; only the text after it is new."""
    calls: list[int] = []

    def encode(piece: str) -> list[int]:
        calls.append(len(piece))
        return _whole(_RAW, piece)

    encoder = SegmentEncoder(encode, {"<|im_end|>": 4})
    system = "You are a careful assistant. " * 2000  # 58k characters
    for turn in range(3):
        text = f"{system}<|im_end|>question {turn}<|im_end|>"
        assert encoder.encode(text) == _whole(_RAW, text)
    assert calls.count(len(system)) == 1


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({}, True),
        ({"added_tokens": [{"id": 1, "content": "<s>", "lstrip": True}]}, False),
        ({"added_tokens": [{"id": 1, "content": "<s>", "single_word": True}]}, False),
        (
            {
                "normalizer": {"type": "NFC"},
                "added_tokens": [{"id": 1, "content": "<s>", "normalized": True}],
            },
            False,
        ),
        # Normalized and raw tokens inside each other: cut in two passes, as the library does.
        (
            {
                "added_tokens": [
                    {"id": 1, "content": "<a>", "normalized": True},
                    {"id": 2, "content": "<a>b", "normalized": False},
                ]
            },
            True,
        ),
        ({"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "first"}}, False),
        ({"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "always"}}, True),
        (
            {
                "pre_tokenizer": {
                    "type": "Sequence",
                    "pretokenizers": [{"type": "Digits"}, {"type": "SomethingNew"}],
                }
            },
            False,
        ),
        ({"model": {"type": "SomethingNew"}}, False),
    ],
)
def test_only_position_independent_tokenizers_are_segmented(
    change: dict[str, Any], expected: bool
) -> None:
    spec: dict[str, Any] = {
        "added_tokens": [{"id": 1, "content": "<s>"}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel"},
        "model": {"type": "BPE"},
    }
    spec.update(change)
    assert segmentable(spec) is expected


def _trained(tmp_path: Path, prepend_scheme: str) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    tokenizer.decoder = decoders.Metaspace(prepend_scheme=prepend_scheme)
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", "東京 naïve"] * 20
    tokenizer.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>"])
    )
    directory = tmp_path / prepend_scheme
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize("scheme", ["first", "always"])
def test_metaspace_tokenizers_encode_like_the_library(tmp_path: Path, scheme: str) -> None:
    directory = _trained(tmp_path, scheme)
    ours = TextTokenizer(directory)
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    # "first" prepends only at the start of the whole text: piecewise would differ.
    assert ours.segmented is (scheme == "always")
    for text in ("hello world</s> the fox", "<s>the lazy dog<s> hello", " quick</s>"):
        assert ours.encode(text, False) == _whole(raw, text)
        assert ours.encode(text, False) == _whole(raw, text)


def test_chat_prompts_sent_to_the_engine_match_transformers(
    scripted_http: httpx.Client, scripted: ScriptedEngine
) -> None:
    hf: Any = PreTrainedTokenizerFast.from_pretrained(str(TINY_TOKENIZER))
    system = {"role": "system", "content": "You answer in one line. ü 東京"}
    for question in ("What is 2+2?", "And 3+3?", "What is 2+2?"):
        messages = [system, {"role": "user", "content": question}]
        response = scripted_http.post(
            "/v1/chat/completions", json={"model": SCRIPTED_MODEL, "messages": messages}
        )
        assert response.status_code == 200, response.text
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = hf.encode(text, add_special_tokens=False)
        assert list(scripted.requests[-1].prompt_token_ids) == expected


@pytest.fixture(scope="module")
def large_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_large_vocab_tokenizer(tmp_path_factory.mktemp("large-vocab"))


def test_a_large_added_vocabulary_encodes_every_probe_like_the_library(large_vocab: Path) -> None:
    ours = TextTokenizer(large_vocab)
    raw = Tokenizer.from_file(str(large_vocab / "tokenizer.json"))
    assert ours.segmented
    texts = segments.probes(added_token_texts())
    expected = [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]
    assert [ours.encode(text, False) for text in texts] == expected


_LARGE_TEXTS = st.lists(
    st.sampled_from(_WORDS + _ADDED + added_token_texts()[:400] + ["ab", "a", "东", "<|"])
    | st.text(max_size=6),
    max_size=24,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_LARGE_TEXTS)
def test_a_large_added_vocabulary_matches_on_any_text(large_vocab: Path, text: str) -> None:
    ours = _large(large_vocab)
    raw = _large_raw(large_vocab)
    assert ours.encode(text, False) == _whole(raw, text)
    assert ours.encode(text, True) == _whole(raw, text, True)


@functools.cache
def _large(directory: Path) -> TextTokenizer:
    return TextTokenizer(directory)


@functools.cache
def _large_raw(directory: Path) -> Tokenizer:
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def test_a_gateway_on_a_large_added_vocabulary_sends_the_library_ids(large_vocab: Path) -> None:
    engine = ScriptedEngine(scripted_info(large_vocab), large_vocab)
    hf: Any = PreTrainedTokenizerFast.from_pretrained(str(large_vocab))
    content = "Split ab12 and ab123 at word7 <|reserved_40|> 丁丂 东京 and ab1x"
    messages = [{"role": "user", "content": content}]
    with (
        serve_app(create_app(GatewaySettings(), engine=engine)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        response = client.post(
            "/v1/chat/completions", json={"model": SCRIPTED_MODEL, "messages": messages}
        )
    assert response.status_code == 200, response.text
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = hf.encode(text, add_special_tokens=False)
    assert list(engine.requests[-1].prompt_token_ids) == expected
    assert len(expected) < len(hf.encode(text.replace("ab12", "a b12"), add_special_tokens=False))


@pytest.fixture(scope="module")
def overlapping(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Normalized tokens that overlap a raw one, so the two cuts meet at piece edges."""
    from tokenizers import AddedToken

    directory = tmp_path_factory.mktemp("overlapping")
    tokenizer = Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<a>b", special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken(t, normalized=True) for t in ("<a>", "b<c", "zz<a", "c d")])
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


_OVERLAPPING = st.lists(
    st.sampled_from(["<a>b", "<a>", "b<c", "zz<a", "c d", "<", "a", ">", "b", "c", " ", "z"]),
    max_size=16,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_OVERLAPPING)
def test_raw_and_normalized_tokens_that_overlap_cut_like_the_library(
    overlapping: Path, text: str
) -> None:
    ours = _large(overlapping)
    assert ours.segmented
    assert ours.encode(text, False) == _whole(_large_raw(overlapping), text)
