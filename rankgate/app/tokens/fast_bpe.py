"""Plain-text encoding of byte-level BPE tokenizers through ``tiktoken``, for the same ids.

A never-seen prompt costs the gateway its tokenization, and ``tokenizers`` encodes a
byte-level BPE text four to five times slower than ``tiktoken`` does (a new 220 KB text with
a 32k vocabulary: 57 ms against 13 ms of CPU on one thread). The two compute the same thing
when the BPE's merge order is its vocabulary order: ``tiktoken`` merges the adjacent pair whose
joined bytes have the lowest rank, ``tokenizers`` the pair listed first among the merges, and
for a vocabulary whose i-th merge makes a token of a larger id than the merge before it (what
BPE training produces: GPT-2, Llama 3, Qwen) those are the same pair.

:func:`candidate` admits only that case: a byte-level BPE with no normalizer, no dropout, no
byte fallback and no word prefixes or suffixes, pre-tokenized by GPT-2's pattern or by a
``Split`` pattern followed by byte-level mapping, whose merges are in vocabulary order and
whose vocabulary holds every byte. :meth:`FastBpe.agrees` then checks it against
``tokenizers`` on probe texts and on every token of the vocabulary; until that check has
passed (it runs in the background, see :class:`rankgate.app.tokens.tokenizer.TextTokenizer`) the
gateway encodes with ``tokenizers``. Added tokens never reach it: the segment encoder cuts
them out first (:mod:`rankgate.app.tokens.segments`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import tiktoken

from rankgate.app.tokens.text_split import PROBES

# GPT-2's pre-tokenizing pattern: what ``ByteLevel(use_regex=True)`` splits by.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _pattern(pre: Any) -> str | None:
    """The pre-tokenizing regex, for the two shapes ``tiktoken`` reproduces."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre.get("type") != "Sequence":
        return None
    members = pre.get("pretokenizers") or []
    if len(members) != 2:
        return None
    split, byte_level = members
    pattern = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") != "Split"
        or not isinstance(pattern, str)
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex", True)
    ):
        return None
    return pattern


def _merge_pair(merge: Any) -> tuple[str, str] | None:
    if isinstance(merge, str):
        left, _, right = merge.partition(" ")
        return (left, right) if right else None
    if isinstance(merge, list) and len(merge) == 2:
        return str(merge[0]), str(merge[1])
    return None


def candidate(spec: dict[str, Any], byte_decoder: dict[str, int]) -> FastBpe | None:
    """A ``tiktoken`` encoder for ``spec`` if its components allow one, not yet checked."""
    model = spec.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("dropout")
        or model.get("byte_fallback")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
        or spec.get("normalizer") is not None
        or (spec.get("decoder") or {}).get("type") != "ByteLevel"
    ):
        return None
    pattern = _pattern(spec.get("pre_tokenizer"))
    vocab: dict[str, int] = model.get("vocab") or {}
    if pattern is None or not vocab:
        return None
    ranks: dict[bytes, int] = {}
    for token, rank in vocab.items():
        try:
            ranks[bytes(byte_decoder[c] for c in token)] = rank
        except KeyError:
            return None
    if len(ranks) != len(vocab) or any(bytes([b]) not in ranks for b in range(256)):
        return None
    previous = -1
    for merge in model.get("merges") or ():
        pair = _merge_pair(merge)
        made = vocab.get(pair[0] + pair[1]) if pair is not None else None
        if made is None or made <= previous:
            return None
        previous = made
    try:
        encoding = tiktoken.Encoding(
            "rankgate-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except ValueError:
        return None
    # Added tokens are cut out of the text before it is encoded: they are not checked.
    added = {str(token.get("content")) for token in spec.get("added_tokens", ())}
    texts = [token.decode("utf-8", "replace") for token in ranks]
    return FastBpe(encoding, [text for text in texts if text not in added])


class FastBpe:
    """``tiktoken``'s encoding of plain text (no added tokens in it, none added)."""

    def __init__(self, encoding: tiktoken.Encoding, vocab_texts: Sequence[str]) -> None:
        self._encoding = encoding
        self._vocab_texts = vocab_texts
        self.encode: Callable[[str], list[int]] = encoding.encode_ordinary

    def agrees(self, encode_many: Callable[[list[str]], list[list[int]]]) -> bool:
        """Whether ``encode_many`` (``tokenizers``, no special tokens) gives the same ids for
        the probes and for the text of every vocabulary token."""
        texts = [*PROBES, " ".join(PROBES), *self._vocab_texts]
        # Checked once: the vocabulary's texts are not kept.
        self._vocab_texts = ()
        expected = encode_many(texts)
        found = self._encoding.encode_ordinary_batch(texts, num_threads=1)
        return found == expected


# Verdicts by the tokenizer file's digest: a process that loads the same tokenizer again (each
# test's gateway, a reload) reuses the checked encoder instead of checking again. Few
# tokenizers are ever loaded; the bound only guards against a process that loads many.
_VERDICTS_MAX = 8
_verdicts: dict[bytes, FastBpe | None] = {}
_verdicts_lock = threading.Lock()


def digest(tokenizer_json: bytes) -> bytes:
    return hashlib.blake2b(tokenizer_json, digest_size=16).digest()


def known(key: bytes) -> tuple[bool, FastBpe | None]:
    """(whether ``key``'s tokenizer was checked, its encoder if it passed)."""
    with _verdicts_lock:
        if key in _verdicts:
            return True, _verdicts[key]
        return False, None


def remember(key: bytes, fast: FastBpe | None) -> None:
    with _verdicts_lock:
        if len(_verdicts) >= _VERDICTS_MAX:
            _verdicts.clear()
        _verdicts[key] = fast
