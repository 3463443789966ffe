"""Gateway start-up and prompt encoding with a large added vocabulary (32k added tokens).

Builds the test tokenizer with ``--added`` added, non-special tokens on top of the tiny one
(tests/support/large_vocab.py), and the same with 32 of them, and for those and for the tiny
tokenizer alone prints (normalized added tokens take a second cut inside each piece, as in
``tokenizers``; that is what the 32 row adds, their number is what the last row adds):

- ``TextTokenizer()`` construction in this process (best of ``--rounds``);
- ``rankgate serve`` from process start to ``/ready`` 200 in front of a mock engine that is
  already serving (median of ``--rounds``);
- encoding one chat prompt of ~250 characters through the piece cache and with every piece
  new, per call (best of 5 runs).

    .venv/bin/python bench/large_vocab_startup.py [--added 32000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import peers

from rankgate.app.tokens.tokenizer import TextTokenizer
from tests.support.large_vocab import write_large_vocab_tokenizer

PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Write a short poem about data-parallel routing, please, in the style of a sonnet by "
    "Shakespeare, with a title and four stanzas of four lines.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def construction(directory: Path, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        TextTokenizer(directory)
        best = min(best, time.perf_counter() - start)
    return best


def encode_cost(directory: Path) -> tuple[float, float]:
    tokenizer = TextTokenizer(directory)
    n = 2000
    cached, fresh = float("inf"), float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            tokenizer.encode(PROMPT, False)
        cached = min(cached, (time.perf_counter() - start) / n)
        texts = [f"{PROMPT}{i}" for i in range(n)]
        start = time.perf_counter()
        for text in texts:
            tokenizer.encode(text, False)
        fresh = min(fresh, (time.perf_counter() - start) / n)
    return cached, fresh


def gateway_start(directory: Path, rounds: int) -> float:
    times: list[float] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="rankgate-vocab-") as tmp:
        engine = peers.start_mock_engine(stack, Path(tmp), tokenizer=directory)
        for _ in range(rounds):
            with ExitStack() as own:
                start = time.perf_counter()
                peers.start_rankgate(own, engine, "kv", poll=0.02)
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--added", type=int, default=32_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rankgate-vocab-") as tmp:
        # The same added-token shapes at 32 and at --added: what grows with their number.
        few = write_large_vocab_tokenizer(Path(tmp) / "few", 32)
        large = write_large_vocab_tokenizer(Path(tmp) / "large", args.added)
        rows = []
        for name, directory in (
            ("tiny (10 added)", peers.TINY_TOKENIZER),
            ("tiny + 32 added", few),
            (f"tiny + {args.added} added", large),
        ):
            built = construction(directory, args.rounds)
            cached, fresh = encode_cost(directory)
            start = gateway_start(directory, args.rounds)
            rows.append((name, built, start, cached, fresh))
    print(f"Large added vocabulary. {peers.machine()}")
    print()
    print(
        "| tokenizer | TextTokenizer() s | rankgate serve to /ready s | encode, cached us |"
        " encode, new pieces us |"
    )
    print("|---|---|---|---|---|")
    for name, built, start, cached, fresh in rows:
        print(f"| {name} | {built:.3f} | {start:.2f} | {cached * 1e6:.1f} | {fresh * 1e6:.1f} |")


if __name__ == "__main__":
    main()
