"""Request-side and event-side hashing agree, and keep salts, adapters and images apart."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankgate.sidecar.routing.hashing import (
    SALT_TAG,
    chain_hashes,
    chain_seed,
    event_block_keys,
    prompt_chain,
    prompt_keys,
    text_key,
)
from rankgate.sidecar.types import MediaInput

tokens_st = st.lists(st.integers(min_value=0, max_value=200_000), max_size=80)


@given(tokens_st, st.integers(min_value=1, max_value=8))
def test_prefix_blocks_hash_alike_and_chain(tokens: list[int], block: int) -> None:
    keys = prompt_keys(tokens, block).hashes
    assert len(keys) == len(tokens) // block
    longer = prompt_keys([*tokens, 1, 2, 3, 4, 5, 6, 7, 8], block).hashes
    assert longer[: len(keys)] == keys
    # Events carry the same tokens in separate batches chained by parent: same keys.
    if len(keys) >= 2:
        first = chain_hashes(tokens[:block], block, chain_seed(None, None))
        rest = chain_hashes(tokens[block : len(keys) * block], block, first[-1])
        assert first + rest == keys


def test_a_changed_block_changes_every_later_key() -> None:
    base = prompt_keys(list(range(16)), 4).hashes
    changed = prompt_keys([0, 1, 2, 3, 9, 5, 6, 7, *range(8, 16)], 4).hashes
    assert base[0] == changed[0]
    assert all(a != b for a, b in zip(base[1:], changed[1:], strict=True))


def test_salt_and_adapter_seed_the_chain() -> None:
    tokens = list(range(8))
    plain = prompt_keys(tokens, 4).hashes
    salted = prompt_keys(tokens, 4, salt="s").hashes
    adapted = prompt_keys(tokens, 4, lora_name="s").hashes
    assert len({plain[0], salted[0], adapted[0]}) == 3
    salt, images = event_block_keys([[SALT_TAG + "s"], None], None)
    assert (salt, images) == ("s", None)
    assert chain_hashes(tokens, 4, chain_seed(salt, None)) == salted


def test_event_extra_keys_shapes() -> None:
    uuid = "f" * 64
    lora = "sql"
    salt, images = event_block_keys(
        [[lora, SALT_TAG + "t", [uuid, 3]], [lora, f"{lora}:{uuid}"], [lora], None], lora
    )
    assert salt == "t"
    assert images == [(text_key(uuid),), (text_key(uuid),), (), ()]


def test_images_expand_in_place() -> None:
    image = 77
    media = (MediaInput(uuid="x", num_tokens=6),)
    keys = prompt_keys([1, 2, image, 3, 4, 5, 6], 4, media=media, media_positions=[2])
    assert keys.prompt_tokens == 12
    expanded = [1, 2, *[image] * 6, 3, 4, 5, 6]
    per_block = [(text_key("x"),), (text_key("x"),), ()]
    assert keys.hashes == chain_hashes(expanded, 4, 0, per_block)
    # Unknown size: only the text before the image is hashed.
    partial = prompt_keys(
        [1, 2, 3, 4, 5, image, 6], 4, media=(MediaInput(uuid="x"),), media_positions=[5]
    )
    assert partial.hashes == prompt_keys([1, 2, 3, 4], 4).hashes
    # Unknown position: nothing.
    assert prompt_keys([1, 2, 3, 4, image], 4, media=media).hashes == []


def test_keys_are_the_same_in_another_process() -> None:
    code = (
        "from rankgate.sidecar.routing.hashing import prompt_keys;"
        "print(prompt_keys(list(range(40)), 8, salt='s', lora_name='l').hashes)"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1
    assert runs.pop().strip() == str(
        prompt_keys(list(range(40)), 8, salt="s", lora_name="l").hashes
    )


@pytest.mark.parametrize("images", [False, True])
def test_a_chain_hashed_in_steps_is_the_prompt_hashed_at_once(images: bool) -> None:
    image = 77
    tokens = [*range(10), image, *range(10, 40)]
    media = (MediaInput(uuid="x", num_tokens=9),) if images else ()
    positions = [10] if images else None
    whole = prompt_keys(tokens, 4, salt="s", media=media, media_positions=positions)
    chain = prompt_chain(tokens, 4, salt="s", media=media, media_positions=positions)
    assert chain.prompt_tokens == whole.prompt_tokens
    assert chain.blocks == len(whole.hashes)
    kept = chain.extend(2)
    assert kept == whole.hashes[:2]
    assert not chain.finished
    chain.extend(5)
    chain.extend(3)  # never shrinks
    assert kept == whole.hashes[:5]
    assert chain.finish() is kept  # one list, grown in place for whoever holds it
    assert kept == whole.hashes
    assert chain.finished
    assert chain.extend(chain.blocks + 10) == whole.hashes
