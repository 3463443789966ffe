"""Long texts encoded as pieces cut at single spaces between words, for the same ids.

``tokenizers`` pays more than linearly for one long input: a never-seen 220 KB prompt costs
about a third more CPU encoded whole than cut into pieces of a few kilobytes (on a byte-level
BPE tokenizer of 32k tokens; ``bench/long_prompts.py`` measures it through the gateway), and
pieces given to ``encode_batch_fast`` together also spread over the library's threads.

Cutting is only sound where the tokenizer never lets a token span the cut. For the word
splitting pre-tokenizers (GPT-2's byte-level pattern, the ``Split`` patterns of Llama 3 and
Qwen, whitespace and BERT splitting) a space between two non-space characters always starts a
new pre-token, so a cut just before such a space changes nothing. :func:`splittable` admits
only those components and normalizers that act on each character alone, and
:meth:`TextSplitter.agrees` checks the tokenizer on probes cut at every such space before the
gateway relies on it; a tokenizer that fails is encoded whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

# Pieces of at least this many characters (the last may be shorter).
PIECE_CHARS = 4096
# A space with a non-space character on each side: where a cut leaves every pre-token whole.
_CUT = re.compile(r"(?<=\S) (?=\S)")
_SPLITTING = frozenset({"Split", "Whitespace", "WhitespaceSplit", "BertPreTokenizer"})
_PASSIVE = frozenset({"Digits", "Punctuation", "UnicodeScripts"})
_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
# Texts both encoders' checks run on (:mod:`rankgate.app.tokens.fast_bpe` too): words, numbers,
# punctuation, contractions in either case, scripts, emoji, runs of whitespace, code.
PROBES = (
    "the quick brown fox jumps over the lazy dog",
    "digits 12345 67 8 and 3.14159 or 1,000,000 items",
    "punctuation! really? yes: (a) [b] {c} 'quoted' \"double\" end.",
    "it's we're they've I'm you'll he'd can't IT'S WE'RE",
    "naïve café 東京 Ελληνικά русский 😀 emoji 👍🏽 mixed",
    "tabs\tand\nnew lines\n\nwith  two spaces   three\r\n",
    "def f(x):\n    return x + 1  # code with indentation\n",
    "CamelCase snake_case kebab-case URL https://example.com/a?b=c&d=e",
    " leading space and trailing ",
    "\u00a0non-breaking\u2003em space\u200bzero width",
)


def _pre_tokenizer_ok(spec: Any) -> bool:
    """Whether every member splits before word-leading spaces or only inside words, and at
    least one of them splits at all."""
    members = spec.get("pretokenizers", []) if spec.get("type") == "Sequence" else [spec]
    splits = False
    for member in members:
        kind = member.get("type")
        if kind == "ByteLevel":
            if member.get("add_prefix_space"):
                return False
            splits = splits or bool(member.get("use_regex", True))
        elif kind in _SPLITTING:
            splits = True
        elif kind not in _PASSIVE:
            return False
    return splits


def _normalizer_ok(spec: Any) -> bool:
    if spec is None:
        return True
    members = spec.get("normalizers", []) if spec.get("type") == "Sequence" else [spec]
    return all(member.get("type") in _NORMALIZERS for member in members)


def splittable(spec: dict[str, Any]) -> bool:
    """Whether a ``tokenizer.json``'s components allow cutting a text at word spaces."""
    pre = spec.get("pre_tokenizer")
    return pre is not None and _pre_tokenizer_ok(pre) and _normalizer_ok(spec.get("normalizer"))


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut just before spaces between words, into pieces of ``size`` characters or
    more (a text with no such space stays whole)."""
    cuts: list[str] = []
    start = 0
    search = _CUT.search
    while True:
        found = search(text, start + size) if start + size < len(text) else None
        if found is None:
            cuts.append(text[start:])
            return cuts
        cuts.append(text[start : found.start()])
        start = found.start()


class TextSplitter:
    """Encodes long texts piecewise with ``encode_many`` (ids of each text, no special
    tokens added), equal to encoding them whole."""

    def __init__(self, encode_many: Callable[[list[str]], list[list[int]]]) -> None:
        self._encode_many = encode_many

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._encode_many(pieces(text)):
            ids += part
        return ids

    def agrees(self, encode_whole: Callable[[str], list[int]], extra: Iterable[str] = ()) -> bool:
        """Whether cutting at every word space of the probes (and of ``extra``, texts built
        from the tokenizer's own added tokens) leaves their ids unchanged."""
        for text in (*PROBES, " ".join(PROBES), *extra):
            cut = [part for part in pieces(text, 1) if part]
            joined = [i for part in self._encode_many(cut) for i in part]
            if joined != encode_whole(text):
                return False
        return True
