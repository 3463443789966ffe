"""Prompt tokenization piece by piece between added tokens, each piece's ids remembered.

``tokenizers`` cuts a text at its added tokens (``<|im_start|>``, ``<|eot_id|>``, ...) before it
normalizes, pre-tokenizes and runs the model, and it treats each piece between them on its
own. Encoding those pieces separately and joining the ids is therefore the same as encoding
the whole text, and the pieces repeat across requests: a system prompt, the earlier turns of
a conversation, a role header. Their ids are looked up instead of recomputed, which turns the
tokenizer's cost (tens of microseconds per hundred characters) into a dictionary lookup for
everything but the new text.

That equality holds only for tokenizers whose pieces do not depend on where they sit in the
text, so :func:`segmentable` admits the components known to work that way and nothing else
(no stripping or single-word added tokens, no ``Metaspace`` that prepends only at the start
of the text); the encoder also checks itself against whole-text encoding on a set of probes
when it is built and declines to segment when any differ.

The cut itself is an Aho-Corasick automaton with leftmost-longest matching, the same search
``tokenizers`` runs, first over the tokens it matches on the raw text and then over the
normalized ones inside each piece between those, as the library does. Its cost per request
does not grow with the number of added tokens, and building it for tens of thousands of them
takes milliseconds.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import ahocorasick_rs

# Pre-tokenizers and normalizers that treat a piece the same wherever it sits in the text.
_SAFE_PRE_TOKENIZERS = frozenset(
    {
        "ByteLevel",
        "Split",
        "Digits",
        "Punctuation",
        "Whitespace",
        "WhitespaceSplit",
        "BertPreTokenizer",
        "CharDelimiterSplit",
        "UnicodeScripts",
    }
)
_SAFE_NORMALIZERS = frozenset(
    {
        "NFC",
        "NFD",
        "NFKC",
        "NFKD",
        "Lowercase",
        "Strip",
        "StripAccents",
        "Replace",
        "Prepend",
        "Nmt",
        "BertNormalizer",
        "Precompiled",
    }
)
_SAFE_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
_PROBES = (
    "Hello world",
    " leading space and  two",
    "line\nbreaks\n\n and\ttabs ",
    "digits 12345 and punctuation!?",
    "naïve café 東京 😀",
    "",
    " ",
    "\n",
)

# Added tokens the encoder tries when it checks itself (see :func:`probes`).
MAX_PROBED_TOKENS = 256
# Entries and their total size in memory (text and ids, see :func:`piece_bytes`); the oldest
# go first. Long pieces are kept too: a long system prompt or a pasted document is exactly
# what repeats, and re-encoding 30k tokens costs tens of milliseconds.
MAX_PIECES = 8192
MAX_CACHED_BYTES = 64 << 20
# No one piece may take more than this share of the budget (one huge paste never flushes the
# rest).
MAX_PIECE_SHARE = 4


def piece_bytes(piece: str, ids: tuple[int, ...]) -> int:
    """What a cached piece holds in memory: its text, its tuple, an int object per id (ids
    past 256 are not shared) and the entry in the ordered dict."""
    return sys.getsizeof(piece) + 36 * len(ids) + 160


def _component_ok(spec: Any, safe: frozenset[str]) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        members = spec.get("pretokenizers") or spec.get("normalizers") or []
        return all(_component_ok(member, safe) for member in members)
    if kind == "Metaspace":
        # "first" prepends only to the piece at the very start of the text.
        return safe is _SAFE_PRE_TOKENIZERS and spec.get("prepend_scheme") in ("always", "never")
    return kind in safe


def segmentable(spec: dict[str, Any]) -> bool:
    """Whether a ``tokenizer.json`` encodes each piece between added tokens independently."""
    normalized = False
    for token in spec.get("added_tokens", ()):
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
        content = token.get("content")
        if not content or not isinstance(content, str):
            return False
        normalized = normalized or bool(token.get("normalized"))
    # ``tokenizers`` matches normalized tokens in the normalized text: the pieces agree with
    # the raw text's only without a normalizer.
    if normalized and spec.get("normalizer") is not None:
        return False
    model = spec.get("model") or {}
    return (
        model.get("type") in _SAFE_MODELS
        and _component_ok(spec.get("normalizer"), _SAFE_NORMALIZERS)
        and _component_ok(spec.get("pre_tokenizer"), _SAFE_PRE_TOKENIZERS)
    )


class _Cut:
    """One pass of the added-token search: leftmost-longest, as ``tokenizers`` does it."""

    __slots__ = ("find", "ids")

    def __init__(self, tokens: dict[str, int]) -> None:
        texts = list(tokens)
        self.ids = [tokens[t] for t in texts]
        automaton = ahocorasick_rs.AhoCorasick(
            texts, matchkind=ahocorasick_rs.MatchKind.LeftmostLongest
        )
        self.find = automaton.find_matches_as_indexes


class SegmentEncoder:
    """Whole-text-equivalent encoding (no special tokens added) from cached pieces.

    ``encode_piece`` encodes one piece without adding special tokens; ``added`` maps each added
    token's text to its id, and ``normalized`` the added tokens that ``tokenizers`` looks for
    only in the pieces between the others (those marked ``normalized``). Safe to call from
    several threads (a long prompt is tokenized off the event loop).
    """

    def __init__(
        self,
        encode_piece: Callable[[str], list[int]],
        added: dict[str, int],
        normalized: dict[str, int] | None = None,
    ) -> None:
        self._encode_piece = encode_piece
        self._outer = _Cut(added) if added else None
        self._inner = _Cut(normalized) if normalized else None
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        cut = self._outer
        if cut is None or self._inner is not None:
            if cut is not None and self._inner is not None:
                self._two_cuts(text, cut, self._inner, ids)
            else:
                self._between(text, cut, ids)
            return ids
        # The common case, one pass, with the piece lookup inline: this runs per request.
        pieces = self._pieces
        table = cut.ids
        pos = 0
        for index, start, end in cut.find(text):
            if start > pos:
                piece = text[pos:start]
                cached = pieces.get(piece)
                if cached is None:
                    ids.extend(self._miss(piece))
                else:
                    try:  # noqa: SIM105 (cheaper than contextlib.suppress per lookup)
                        pieces.move_to_end(piece)
                    except KeyError:
                        pass  # evicted by another thread just now
                    ids.extend(cached)
            ids.append(table[index])
            pos = end
        if pos < len(text):
            self._piece(text[pos:] if pos else text, ids)
        return ids

    def _two_cuts(self, text: str, outer: _Cut, inner: _Cut, ids: list[int]) -> None:
        """Both passes with one search each over the whole text: the inner matches that lie
        inside a piece between outer tokens are the ones a search of that piece alone would
        find, unless one reaches across the piece's edge; only such a piece is searched
        again on its own."""
        found = inner.find(text)
        count = len(found)
        table = inner.ids
        j = 0
        pos = 0
        for index, start, end in (*outer.find(text), (-1, len(text), len(text))):
            if start > pos:
                while j < count and found[j][2] <= pos:
                    j += 1
                first = j
                while j < count and found[j][2] <= start:
                    j += 1
                across = (first < count and found[first][1] < pos) or (
                    j < count and found[j][1] < start
                )
                if across:
                    self._between(text[pos:start], inner, ids)
                else:
                    at = pos
                    for k in range(first, j):
                        which, begin, finish = found[k]
                        if begin > at:
                            self._piece(text[at:begin], ids)
                        ids.append(table[which])
                        at = finish
                    if at < start:
                        self._piece(text[at:start], ids)
            if index >= 0:
                ids.append(outer.ids[index])
            pos = end

    def _between(self, text: str, cut: _Cut | None, ids: list[int]) -> None:
        """Cut ``text`` at the outer tokens (when ``cut`` is the outer pass) and each piece
        between at the normalized ones."""
        if cut is None:
            cut = self._inner
            if cut is None:
                self._piece(text, ids)
                return
        inner = self._inner if cut is self._outer else None
        pos = 0
        table = cut.ids
        for index, start, end in cut.find(text):
            if start > pos:
                self._between_or_piece(text[pos:start], inner, ids)
            ids.append(table[index])
            pos = end
        if pos < len(text):
            self._between_or_piece(text[pos:] if pos else text, inner, ids)

    def _between_or_piece(self, text: str, inner: _Cut | None, ids: list[int]) -> None:
        if inner is None:
            self._piece(text, ids)
        else:
            self._between(text, inner, ids)

    def _piece(self, piece: str, ids: list[int]) -> None:
        cached = self._pieces.get(piece)
        if cached is None:
            ids.extend(self._miss(piece))
            return
        try:  # noqa: SIM105 (cheaper than contextlib.suppress per lookup)
            self._pieces.move_to_end(piece)
        except KeyError:
            pass  # evicted by another thread just now
        ids.extend(cached)

    def _miss(self, piece: str) -> list[int]:
        ids = self._encode_piece(piece)
        value = tuple(ids)
        size = piece_bytes(piece, value)
        if size > MAX_CACHED_BYTES // MAX_PIECE_SHARE:
            return ids
        with self._lock:
            pieces = self._pieces
            if piece not in pieces:
                pieces[piece] = value
                self._bytes += size
                while len(pieces) > MAX_PIECES or self._bytes > MAX_CACHED_BYTES:
                    old_piece, old_ids = pieces.popitem(last=False)
                    self._bytes -= piece_bytes(old_piece, old_ids)
        return ids

    def agrees(self, encode_whole: Callable[[str], list[int]], probes: Iterable[str]) -> bool:
        """Whether this encoder matches whole-text encoding on every probe."""
        return all(self.encode(text) == encode_whole(text) for text in probes)

    @property
    def size(self) -> int:
        return len(self._pieces)

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def __contains__(self, piece: str) -> bool:
        return piece in self._pieces

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._bytes = 0


def probes(added: Iterable[str], limit: int | None = None) -> list[str]:
    """Texts that mix added tokens with the probe pieces, for :meth:`agrees`.

    With ``limit``, only that many tokens are tried: the first half of them in order (the
    raw ones, a template's markers, come first) and the rest spread evenly over the others.
    The automaton finds every token by construction; what the probes check is that the
    pieces between tokens encode the same wherever they sit, which a sample shows as well.
    """
    tokens = list(added)
    if limit is not None and len(tokens) > limit:
        head = limit // 2
        step = -(-(len(tokens) - head) // (limit - head))
        tokens = tokens[:head] + tokens[head::step]
    texts = list(_PROBES)
    for i, token in enumerate(tokens):
        a, b = _PROBES[i % len(_PROBES)], _PROBES[(i + 3) % len(_PROBES)]
        texts.append(f"{token}{a}{token}{b}")
        texts.append(f"{a}{token}\n{b} {token}")
    if tokens:
        texts.append("".join(f"{t} x{t}" for t in tokens))
    return texts
