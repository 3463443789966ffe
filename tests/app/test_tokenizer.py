"""Finding the tokenizer locally (explicit dir, model dir, HF cache) and per-token bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rankgate.app.tokens.tokenizer import TextTokenizer, TokenizerNotFound, locate_tokenizer
from tests.conftest import TINY_TOKENIZER


def test_explicit_and_model_dir() -> None:
    assert locate_tokenizer(str(TINY_TOKENIZER), "ignored") == TINY_TOKENIZER
    assert locate_tokenizer(str(TINY_TOKENIZER / "tokenizer.json"), "x") == TINY_TOKENIZER
    assert locate_tokenizer(None, str(TINY_TOKENIZER)) == TINY_TOKENIZER


def test_hf_cache_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(TINY_TOKENIZER, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert locate_tokenizer(None, "acme/tiny") == snapshot


def test_not_found_says_where_and_which_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(TokenizerNotFound) as info:
        locate_tokenizer(None, "acme/missing")
    message = str(info.value)
    assert "--tokenizer" in message
    assert "models--acme--missing" in message
    with pytest.raises(TokenizerNotFound, match="--tokenizer"):
        locate_tokenizer(str(tmp_path), "x")


def test_token_bytes_rebuild_text() -> None:
    tok = TextTokenizer(TINY_TOKENIZER)
    text = "naïve 東京 <think>ok</think>"
    ids = tok.encode(text, False)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    assert tok.decode(ids) == text
