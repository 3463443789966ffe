"""A legal ``tokenizer.json`` with tens of thousands of added, non-special tokens.

Models that extend their vocabulary (new scripts, domain words, reserved markers) ship files
like this: the trained model plus a long ``added_tokens`` list. The tokens here mix the shapes
that stress an added-token splitter: markup-like markers, single CJK characters, and words
that are prefixes of one another (``ab1`` inside ``ab12``), all added the way ``transformers``
adds tokens (``normalized``, not special) on top of the test tokenizer's own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

TINY_TOKENIZER = (
    Path(__file__).resolve().parents[2] / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
)

ADDED_TOKENS = 32_000


def added_token_texts(count: int = ADDED_TOKENS) -> list[str]:
    texts: list[str] = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            texts.append(f"<|reserved_{i}|>")
        elif kind == 1:
            texts.append(chr(0x4E00 + i // 4))
        elif kind == 2:
            texts.append(f"ab{i // 4}")
        else:
            texts.append(f" word{i // 4}")
    return texts


def write_large_vocab_tokenizer(directory: Path, count: int = ADDED_TOKENS) -> Path:
    """The tiny tokenizer's files with ``count`` added tokens on top, written to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_TOKENIZER / name, directory / name)
    tokenizer = Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(text, special=False) for text in added_token_texts(count)])
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory
