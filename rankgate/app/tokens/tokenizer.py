"""Finding and loading the served model's tokenizer, locally only, and using it cheaply.

The gateway tokenizes prompts itself and sends token ids, so the tokenizer must match the
engine's model: by default it is read from the model directory vLLM reports (a local path or
the local Hugging Face cache). Nothing is ever downloaded.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer

from rankgate.app.serving.offload import background
from rankgate.app.tokens import fast_bpe
from rankgate.app.tokens.segments import MAX_PROBED_TOKENS, SegmentEncoder, probes, segmentable
from rankgate.app.tokens.text_bound import chars_per_token_bound
from rankgate.app.tokens.text_split import TextSplitter, splittable

_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerNotFound(RuntimeError):
    """No tokenizer could be found; the message lists every place looked at."""


def _hf_hub_dirs() -> list[Path]:
    dirs = [
        Path(os.environ[var])
        for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
        if os.environ.get(var)
    ]
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        dirs.append(Path(hf_home) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` points at, else the newest one holding a tokenizer.json."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidate = repo_dir / "snapshots" / ref.read_text().strip()
        if (candidate / "tokenizer.json").is_file():
            return candidate
    snapshots = sorted(
        (p for p in (repo_dir / "snapshots").glob("*") if (p / "tokenizer.json").is_file()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    return snapshots[0] if snapshots else None


def locate_tokenizer(explicit: str | None, model_id: str) -> Path:
    """The directory holding ``tokenizer.json`` for ``--tokenizer`` or the engine's model id."""
    looked: list[str] = []
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_file() and path.name == "tokenizer.json":
            return path.parent
        if (path / "tokenizer.json").is_file():
            return path
        looked.append(str(path))
        raise TokenizerNotFound(
            f"--tokenizer {explicit!r}: no tokenizer.json at {path}; "
            "point --tokenizer (or RANKGATE_TOKENIZER) at a directory holding tokenizer.json"
        )
    candidates = [Path(model_id).expanduser()]
    for candidate in candidates:
        looked.append(str(candidate))
        if (candidate / "tokenizer.json").is_file():
            return candidate
    if "/" in model_id and not model_id.startswith(("/", ".", "~")):
        repo = "models--" + model_id.replace("/", "--")
        for hub in _hf_hub_dirs():
            looked.append(str(hub / repo))
            snapshot = _snapshot(hub / repo)
            if snapshot is not None:
                return snapshot
    raise TokenizerNotFound(
        f"no tokenizer found for model {model_id!r} (looked in: {', '.join(looked)}); "
        "pass --tokenizer DIR (or set RANKGATE_TOKENIZER) to a directory holding tokenizer.json"
    )


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _bytes_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    directory: Path
    chat_template: str | None
    special_tokens: dict[str, str]


def read_tokenizer_files(directory: Path) -> TokenizerFiles:
    """The chat template and named special tokens, from wherever transformers would save them."""
    config: dict[str, Any] = {}
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        config = orjson.loads(config_path.read_bytes())
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = directory / "chat_template.jinja"
    json_file = directory / "chat_template.json"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    if template is None and json_file.is_file():
        template = orjson.loads(json_file.read_bytes()).get("chat_template")
    special: dict[str, str] = {}
    for name in _SPECIAL_NAMES:
        content = _token_content(config.get(name))
        if content is not None:
            special[name] = content
    return TokenizerFiles(
        directory=directory,
        chat_template=template if isinstance(template, str) else None,
        special_tokens=special,
    )


log = logging.getLogger(__name__)

# Texts longer than this (characters) are encoded through ``encode_batch``.
LONG_TEXT_CHARS = 8192


class TextTokenizer:
    """``tokenizers`` behind the few calls the gateway needs, with per-token text cached."""

    def __init__(self, directory: Path) -> None:
        self.files = read_tokenizer_files(directory)
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        raw = (directory / "tokenizer.json").read_bytes()
        spec = orjson.loads(raw)
        decoder = spec.get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._byte_map = _bytes_decoder() if self._byte_level else {}
        self._added: dict[int, str] = {
            int(t["id"]): str(t["content"]) for t in spec.get("added_tokens", ())
        }
        self.special_ids = frozenset(
            int(t["id"]) for t in spec.get("added_tokens", ()) if t.get("special")
        )
        # Bounded by the vocabulary: one slot per token id, filled on first use.
        self._bytes_cache: list[bytes | None] = [None] * self.vocab_size
        self._specials_add_nothing = False
        # tiktoken for plain text once checked against this tokenizer (see
        # rankgate.app.tokens.fast_bpe).
        self._fast: Callable[[str], list[int]] | None = None
        self._splitter = self._text_splitter(spec)
        self._segments = self._segment_encoder(spec)
        self.fast_checked = threading.Event()
        key = fast_bpe.digest(raw)
        checked, verified = fast_bpe.known(key)
        fast = None
        if not checked and self._segments is not None:
            fast = fast_bpe.candidate(spec, _bytes_decoder())
        if verified is not None:
            self._fast = verified.encode
        if fast is None:
            self.fast_checked.set()
        else:
            background(self._check_fast, fast, key)
        # A text longer than this many characters per token surely has more tokens.
        self.max_chars_per_token = chars_per_token_bound(spec)

    def _text_splitter(self, spec: dict[str, Any]) -> TextSplitter | None:
        # An added token with a space in it could straddle a cut.
        added = [str(t.get("content", "")) for t in spec.get("added_tokens", ())]
        if not splittable(spec) or any(
            not text or any(c.isspace() for c in text) for text in added
        ):
            return None
        splitter = TextSplitter(self._encode_plain_batch)
        extra = [" ".join(added[i : i + 8]) + " tail" for i in range(0, min(len(added), 64), 8)]
        return splitter if splitter.agrees(self._encode_whole, extra) else None

    def _check_fast(self, fast: fast_bpe.FastBpe, key: bytes) -> None:
        try:
            if fast.agrees(self._encode_plain_batch):
                fast_bpe.remember(key, fast)
                self._fast = fast.encode
                log.info("tokenizer: plain text is encoded with tiktoken (same ids, checked)")
            else:
                fast_bpe.remember(key, None)
                log.info("tokenizer: tiktoken disagrees with this tokenizer; not used")
        finally:
            self.fast_checked.set()

    @property
    def fast(self) -> bool:
        """Whether plain text is encoded with tiktoken (:mod:`rankgate.app.tokens.fast_bpe`)."""
        return self._fast is not None

    def _encode_whole(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def _segment_encoder(self, spec: dict[str, Any]) -> SegmentEncoder | None:
        if not segmentable(spec):
            return None
        raw: dict[str, int] = {}
        normalized: dict[str, int] = {}
        for token in spec.get("added_tokens", ()):
            content = str(token["content"])
            # The library's id: a token already in the model's vocabulary keeps that one.
            found = self._tok.token_to_id(content)
            (normalized if token.get("normalized") else raw)[content] = (
                int(token["id"]) if found is None else found
            )
        segments = SegmentEncoder(self._encode_plain, raw, normalized)
        texts = probes([*raw, *normalized], MAX_PROBED_TOKENS)
        if not segments.agrees(self._encode_plain, texts):
            return None
        segments.clear()
        # A post-processor that adds no tokens (byte-level, none) leaves add_special_tokens
        # without effect: such requests are served from the pieces too.
        self._specials_add_nothing = all(
            self._tok.encode(text, add_special_tokens=True).ids == self._encode_plain(text)
            for text in texts
        )
        return segments

    def _encode_plain(self, text: str) -> list[int]:
        fast = self._fast
        if fast is not None:
            return fast(text)
        if len(text) > LONG_TEXT_CHARS:
            if self._splitter is not None:
                return self._splitter.encode(text)
            return self.encode_batch([text], False)[0]
        return self._encode_whole(text)

    @property
    def segmented(self) -> bool:
        """Whether prompts are encoded from cached pieces (see
        :mod:`rankgate.app.tokens.segments`)."""
        return self._segments is not None

    def surely_exceeds(self, text: str, tokens: int) -> bool:
        """Whether ``text`` has more than ``tokens`` tokens, known without encoding it."""
        bound = self.max_chars_per_token
        return bound is not None and len(text) > tokens * bound

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        segments = self._segments
        if segments is not None and (not add_special_tokens or self._specials_add_nothing):
            # Long pieces too: a long system prompt or document is what repeats.
            return segments.encode(text)
        if len(text) > LONG_TEXT_CHARS:
            if self._splitter is not None and not add_special_tokens:
                return self._splitter.encode(text)
            return self.encode_batch([text], add_special_tokens)[0]
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def _encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encode_batch(texts, add_special_tokens=False)

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Encoded with the GIL released (``encode`` holds it for the whole text), so a worker
        thread encoding long prompts leaves the event loop free."""
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: tuple[int, ...]) -> list[str]:
        """Each id's vocabulary entry (``convert_ids_to_tokens``), "" for an unknown id."""
        tok = self._tok
        return [tok.id_to_token(i) or "" for i in ids]

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (what OpenAI's logprob ``bytes`` lists)."""
        if 0 <= token_id < self.vocab_size:
            cached = self._bytes_cache[token_id]
            if cached is not None:
                return cached
        value = self._compute_bytes(token_id)
        if 0 <= token_id < self.vocab_size:
            self._bytes_cache[token_id] = value
        return value

    def _compute_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            try:
                return bytes(self._byte_map[c] for c in piece)
            except KeyError:
                pass
        return self._tok.decode([token_id], skip_special_tokens=False).encode()
