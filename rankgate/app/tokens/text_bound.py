"""How many characters of text one token can stand for at most, read from tokenizer.json.

Tokenizing costs time in proportion to the text, and a prompt far longer than the context
window is refused after tokenizing anyway. When every token covers at most ``L`` characters,
a text of ``n`` characters has at least ``n / L`` tokens, so a text longer than
``max_model_len * L`` characters can be refused without tokenizing it. The bound must be
sound, never a guess: it is computed only for pipelines where it provably holds, and is None
(no early refusal) for any other.

What can break it, and is therefore refused here: a model that maps unbounded runs of text to
one unknown token (WordLevel, WordPiece's whole-word ``[UNK]``, Unigram, BPE with a fused
unknown token); a normalizer or pre-tokenizer that deletes or shortens text (stripping,
regex replacement, whitespace splitting that drops the whitespace). Composing Unicode
normalizers (NFC, NFKC) shorten text by at most three characters to one (Hangul jamo into a
syllable), which the bound allows for; byte-level models count bytes, which are never fewer
than characters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Normalizers that never shorten a text, and those that shorten it by at most this factor.
_KEEP_LENGTH = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_COMPOSING = {"NFC": 3, "NFKC": 3}
# Pre-tokenizers that only split text or map it to at least as many characters.
_SPLIT_ONLY = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})
_KEEPING_SPLITS = frozenset({"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"})


def chars_per_token_bound(spec: Mapping[str, Any]) -> int | None:
    """The most characters of input text any token can stand for (None: no sound bound),
    already multiplied by how much the normalizer may shorten the text."""
    longest = _model_bound(spec.get("model") or {})
    factor = _normalizer_factor(spec.get("normalizer"))
    if longest is None or factor is None or not _pre_tokenizer_keeps(spec.get("pre_tokenizer")):
        return None
    for token in spec.get("added_tokens") or ():
        longest = max(longest, len(str(token.get("content", ""))))
    return max(1, longest) * factor


def _model_bound(model: Mapping[str, Any]) -> int | None:
    if model.get("type") != "BPE":
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk"):
        return None
    vocab = model.get("vocab") or {}
    return max((len(piece) for piece in vocab), default=1)


def _normalizer_factor(normalizer: Mapping[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for member in normalizer.get("normalizers") or ():
            inner = _normalizer_factor(member)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind in _KEEP_LENGTH:
        return 1
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        content = str(normalizer.get("content", ""))
        text = pattern.get("String")
        if not isinstance(text, str) or not text or not content:
            return None
        return max(1, math.ceil(len(text) / len(content)))
    return None


def _pre_tokenizer_keeps(pre: Mapping[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(member) for member in pre.get("pretokenizers") or ())
    if kind == "Split":
        return pre.get("behavior") in _KEEPING_SPLITS
    return kind in _SPLIT_ONLY
