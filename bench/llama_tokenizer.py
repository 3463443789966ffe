"""A Llama-sized tokenizer for the benchmarks, trained here: nothing can be downloaded.

Per-token and per-request costs depend on the tokenizer (its vocabulary size, its merges, how
many added tokens the prompt splitter knows), so the peer benchmarks need one the size of a
real model's rather than the 3k-token test tokenizer: a byte-level BPE with a 32,000-token
vocabulary whose first five ids are the added tokens ChatML needs, like a Llama-style model.
It is trained on this interpreter's standard-library sources (code, comments and docstrings,
in a fixed order, single-threaded) and kept in the user cache, so later runs load it at once.

    .venv/bin/python bench/llama_tokenizer.py [--out DIR]    prints the directory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 32_000
ADDED = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
CORPUS_CHARS = 12_000_000
# Bump when the recipe changes, so a cached tokenizer from an older recipe is not reused.
RECIPE = 1
CACHE = Path.home() / ".cache" / "rankgate" / f"llama-bpe-{VOCAB_SIZE // 1000}k-r{RECIPE}"
TINY = Path(__file__).resolve().parent.parent / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"


def ensure(directory: Path = CACHE) -> Path:
    """The tokenizer directory, trained first (in a child, ~15 s) when it is not there yet."""
    if (directory / "tokenizer.json").is_file():
        return directory
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, __file__, "--out", str(directory)], check=True, env=env, stdout=sys.stderr
    )
    return directory


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages"}
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.rglob("*.py")):
        if skip.intersection(path.relative_to(stdlib).parts):
            continue
        text = path.read_text(errors="replace")
        texts.append(text)
        total += len(text)
        if total >= CORPUS_CHARS:
            break
    return texts


def build(out: Path) -> None:
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in ADDED],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = corpus()
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # The test tokenizer's ChatML template renders with exactly these added tokens.
    template = json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ADDED[0],
        "eos_token": ADDED[1],
        "pad_token": ADDED[2],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": template,
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": ADDED[0], "eos_token": ADDED[1], "pad_token": ADDED[2]}
    (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    tmp.replace(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out is None:
        print(ensure())
        return
    if not (args.out / "tokenizer.json").is_file():
        build(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
