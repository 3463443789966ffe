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
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

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

# Pieces longer than this are encoded each time rather than kept.
MAX_PIECE_CHARS = 8192
# Entries and total token ids kept; the oldest go first.
MAX_PIECES = 8192
MAX_CACHED_TOKENS = 1 << 20


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
    raw: list[str] = []
    normalized: list[str] = []
    for token in spec.get("added_tokens", ()):
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
        content = token.get("content")
        if not content or not isinstance(content, str):
            return False
        (normalized if token.get("normalized") else raw).append(content)
    if normalized:
        # ``tokenizers`` cuts at raw tokens first, then at normalized ones inside each piece:
        # one pass over all of them agrees only without a normalizer and when neither kind
        # of token contains the other.
        if spec.get("normalizer") is not None:
            return False
        if any(a in b or b in a for a in raw for b in normalized):
            return False
    model = spec.get("model") or {}
    return (
        model.get("type") in _SAFE_MODELS
        and _component_ok(spec.get("normalizer"), _SAFE_NORMALIZERS)
        and _component_ok(spec.get("pre_tokenizer"), _SAFE_PRE_TOKENIZERS)
    )


class SegmentEncoder:
    """Whole-text-equivalent encoding (no special tokens added) from cached pieces.

    ``encode_piece`` encodes one piece without adding special tokens; ``added`` maps each added
    token's text to its id. Safe to call from several threads (a long prompt is tokenized off
    the event loop).
    """

    def __init__(self, encode_piece: Callable[[str], list[int]], added: dict[str, int]) -> None:
        self._encode_piece = encode_piece
        self._added = dict(added)
        self._split: Callable[[str], list[str]] = _whole
        if self._added:
            # Longest first: at one position the longest added token wins, as in
            # ``tokenizers``.
            alternatives = sorted(self._added, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")").split
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        parts = self._split(text)
        ids: list[int] = []
        pieces = self._pieces
        added = self._added
        # ``re.split`` with one group alternates text, separator, text, ...
        for i, part in enumerate(parts):
            if i & 1:
                ids.append(added[part])
                continue
            if not part:
                continue
            cached = pieces.get(part)
            if cached is None:
                ids.extend(self._miss(part))
                continue
            try:  # noqa: SIM105 (cheaper than contextlib.suppress per lookup)
                pieces.move_to_end(part)
            except KeyError:
                pass  # evicted by another thread just now
            ids.extend(cached)
        return ids

    def _miss(self, piece: str) -> list[int]:
        ids = self._encode_piece(piece)
        if len(piece) > MAX_PIECE_CHARS:
            return ids
        value = tuple(ids)
        with self._lock:
            pieces = self._pieces
            if piece not in pieces:
                pieces[piece] = value
                self._tokens += len(value)
                while len(pieces) > MAX_PIECES or self._tokens > MAX_CACHED_TOKENS:
                    _, old = pieces.popitem(last=False)
                    self._tokens -= len(old)
        return ids

    def agrees(self, encode_whole: Callable[[str], list[int]], probes: Iterable[str]) -> bool:
        """Whether this encoder matches whole-text encoding on every probe."""
        return all(self.encode(text) == encode_whole(text) for text in probes)

    @property
    def size(self) -> int:
        return len(self._pieces)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def __contains__(self, piece: str) -> bool:
        return piece in self._pieces

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._tokens = 0


def _whole(text: str) -> list[str]:
    return [text]


def probes(added: Iterable[str]) -> list[str]:
    """Texts that mix every added token with the probe pieces, for :meth:`agrees`."""
    tokens = list(added)
    texts = list(_PROBES)
    for i, token in enumerate(tokens):
        a, b = _PROBES[i % len(_PROBES)], _PROBES[(i + 3) % len(_PROBES)]
        texts.append(f"{token}{a}{token}{b}")
        texts.append(f"{a}{token}\n{b} {token}")
    if tokens:
        texts.append("".join(f"{t} x{t}" for t in tokens))
    return texts
