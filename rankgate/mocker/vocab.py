"""The model's vocabulary: token ids, special tokens and how ids become text.

With a tokenizer directory the mock speaks the same ids and text as the real model that ships
it; without one it uses a synthetic vocabulary whose tokens read as numbered words, so a mock
started with nothing but ``--model`` still returns legible text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_WORDLIKE = re.compile(r"^Ġ[A-Za-z]{2,}$")
_IMAGE_TOKENS = ("<|image|>", "<image>", "<|image_pad|>", "<|vision_pad|>")
_AUDIO_TOKENS = ("<|audio|>", "<|audio_pad|>", "<|AUDIO|>", "<audio>")
_VIDEO_TOKENS = ("<|video|>", "<|video_pad|>", "<video>")
_SYNTHETIC_SPECIALS = 8


class TextStream(Protocol):
    """Turns token ids into text one id at a time, holding back incomplete characters."""

    def step(self, token_id: int) -> str: ...


@dataclass(frozen=True)
class Vocabulary:
    size: int
    eos_token_id: int
    special_ids: frozenset[int]
    image_token_id: int | None
    # Ordinary, word-like ids the mock samples from, so output reads as text.
    output_ids: tuple[int, ...]
    tokenizer: Tokenizer | None
    audio_token_id: int | None = None
    video_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError("no tokenizer configured")
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True).ids
        return ids

    def text_stream(self, skip_special_tokens: bool) -> TextStream:
        if self.tokenizer is None:
            return _SyntheticStream(self, skip_special_tokens)
        return _TokenizerStream(self.tokenizer, skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        stream = self.text_stream(skip_special_tokens)
        return "".join(stream.step(i) for i in ids)


class _TokenizerStream:
    __slots__ = ("_stream", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._tokenizer, token_id)
        return piece or ""


class _SyntheticStream:
    __slots__ = ("_skip", "_vocab")

    def __init__(self, vocab: Vocabulary, skip_special_tokens: bool) -> None:
        self._vocab = vocab
        self._skip = skip_special_tokens

    def step(self, token_id: int) -> str:
        if token_id in self._vocab.special_ids:
            return "" if self._skip else f"<|special_{token_id}|>"
        return f" w{token_id}"


def load_vocabulary(
    tokenizer_dir: str | None, vocab_size: int, image_token_id: int | None
) -> Vocabulary:
    """Load a Hugging Face tokenizer directory (or file), or build the synthetic vocabulary."""
    if tokenizer_dir is None:
        specials = frozenset(range(_SYNTHETIC_SPECIALS))
        return Vocabulary(
            size=vocab_size,
            eos_token_id=2,
            special_ids=specials,
            image_token_id=image_token_id if image_token_id is not None else 5,
            output_ids=tuple(range(_SYNTHETIC_SPECIALS, vocab_size)),
            tokenizer=None,
        )
    path = Path(tokenizer_dir)
    file = path / "tokenizer.json" if path.is_dir() else path
    tokenizer = Tokenizer.from_file(str(file))
    config = _read_json(file.parent / "tokenizer_config.json")
    added = tokenizer.get_added_tokens_decoder()
    specials = frozenset(i for i, token in added.items() if token.special)
    eos = _eos_id(tokenizer, config)
    image = image_token_id
    if image is None:
        image = next(
            (i for name in _IMAGE_TOKENS if (i := tokenizer.token_to_id(name)) is not None), None
        )
    audio, video = (
        next((i for name in names if (i := tokenizer.token_to_id(name)) is not None), None)
        for names in (_AUDIO_TOKENS, _VIDEO_TOKENS)
    )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    added_ids = set(added)
    output = tuple(
        i
        for i in range(size)
        if i not in added_ids and _WORDLIKE.match(tokenizer.id_to_token(i) or "")
    )
    if not output:
        output = tuple(i for i in range(size) if i not in added_ids)
    return Vocabulary(
        size=size,
        eos_token_id=eos,
        special_ids=specials,
        image_token_id=image,
        output_ids=output,
        tokenizer=tokenizer,
        audio_token_id=audio,
        video_token_id=video,
    )


def _read_json(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else {}


def _eos_id(tokenizer: Tokenizer, config: dict[str, object]) -> int:
    token = config.get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    candidates = [token] if isinstance(token, str) else []
    candidates += ["<|eos|>", "</s>", "<|endoftext|>", "<|im_end|>", "<eos>"]
    for name in candidates:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return int(found)
    return 0
