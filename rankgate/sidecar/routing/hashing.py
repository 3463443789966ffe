"""Chained block hashes shared by the event side and the request side of the router.

Both sides hash in this process, from token ids, so routing never depends on vLLM's own hash
algorithm or its ``PYTHONHASHSEED`` (SPEC.md section 7). A block's key covers its whole prefix
(the parent key is folded in), the LoRA adapter and cache salt seed the chain, and every image
that overlaps a block folds its identity into that block.

The mixing is CPython's tuple hash over ints: it is seeded by nothing, so it is the same in
every process of one interpreter build, and it is the cheapest 64-bit mix Python offers
(``bench/routing_index.py`` measures it against blake2b). Strings never enter it directly, since
``str`` hashes are randomised per process: :func:`text_key` turns them into ints with blake2b.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import msgspec

from rankgate.sidecar.types import MediaInput

# vLLM mixes the cache salt into the first block and reports it verbatim in that block's
# ``extra_keys``; the sidecar sends it with this tag so it can be told apart from LoRA names and
# image identifiers there.
SALT_TAG = "rankgate-salt:"


def tagged_salt(salt: str) -> str:
    """The cache salt as sent to vLLM (and as it appears in KV-event ``extra_keys``)."""
    return SALT_TAG + salt


EMPTY_SEED = 0


@lru_cache(maxsize=8192)
def text_key(text: str) -> int:
    """A process-independent 63-bit integer for a salt, adapter name or image identity."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def chain_seed(salt: str | None, lora_name: str | None) -> int:
    """The parent key of a prompt's first block: separates salts and adapters completely."""
    if not salt and not lora_name:
        return EMPTY_SEED
    return hash((text_key(salt) if salt else 0, text_key(lora_name) if lora_name else 0))


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    parent: int,
    block_images: Sequence[tuple[int, ...]] | None = None,
    limit: int | None = None,
    start: int = 0,
) -> list[int]:
    """Keys of the full blocks of ``tokens`` from block ``start`` on, each chained on the one
    before (``parent`` is the key of block ``start - 1``, or the chain's seed).

    ``block_images[i]`` holds the image keys overlapping block ``i`` (empty for none).
    ``limit`` caps the block index reached. ``tokens`` should be a tuple: slicing a tuple
    copies pointers only.
    """
    if not isinstance(tokens, tuple):
        tokens = tuple(tokens)
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    out: list[int] = []
    append = out.append
    if block_images is None:
        for begin in range(start * block_size, count * block_size, block_size):
            parent = hash((parent, tokens[begin : begin + block_size]))
            append(parent)
        return out
    for index in range(start, count):
        begin = index * block_size
        images = block_images[index] if index < len(block_images) else ()
        if images:
            parent = hash((parent, tokens[begin : begin + block_size], images))
        else:
            parent = hash((parent, tokens[begin : begin + block_size]))
        append(parent)
    return out


class KeyChain:
    """A prepared prompt's block keys, hashed as far as asked.

    A route decision needs a prompt's keys only as far as some rank may hold its prefix:
    past the first block no rank holds, the match is over. The rest, which the predictions
    and the regret meter take once the request is on its way, is hashed then (:meth:`finish`).
    ``hashes`` grows in place, so whoever kept the list sees every key once it is finished.
    """

    __slots__ = (
        "_block_images",
        "_block_size",
        "_seed",
        "_tokens",
        "blocks",
        "hashes",
        "prompt_tokens",
    )

    def __init__(
        self,
        tokens: tuple[int, ...],
        block_size: int,
        seed: int,
        block_images: Sequence[tuple[int, ...]] | None,
        prompt_tokens: int,
    ) -> None:
        self._tokens = tokens
        self._block_size = block_size
        self._seed = seed
        self._block_images = block_images
        # The expanded prompt's length (images at their expanded size where known), and the
        # blocks that can be hashed: all of them, or those before the first image of unknown
        # size.
        self.prompt_tokens = prompt_tokens
        self.blocks = len(tokens) // block_size
        self.hashes: list[int] = []

    @property
    def finished(self) -> bool:
        return len(self.hashes) >= self.blocks

    def extend(self, blocks: int) -> list[int]:
        """Hash up to ``blocks`` blocks (at most :attr:`blocks`); the keys so far."""
        hashes = self.hashes
        have = len(hashes)
        if blocks > have and have < self.blocks:
            parent = hashes[-1] if have else self._seed
            hashes.extend(
                chain_hashes(
                    self._tokens, self._block_size, parent, self._block_images, blocks, have
                )
            )
        return hashes

    def finish(self) -> list[int]:
        return self.extend(self.blocks)


class PromptKeys(msgspec.Struct, frozen=True, gc=False):
    """A request's block keys and its expanded length.

    ``prompt_tokens`` counts images at their expanded size. When some image's size is unknown
    only the text before it is hashed: the keys reach ``len(hashes) * block_size`` tokens.
    """

    hashes: list[int]
    prompt_tokens: int


def prompt_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: str | None = None,
    lora_name: str | None = None,
    media: Sequence[MediaInput] = (),
    media_positions: Sequence[int] | None = None,
) -> PromptKeys:
    """All of a prepared prompt's block keys (see :func:`prompt_chain`)."""
    chain = prompt_chain(
        token_ids,
        block_size,
        salt=salt,
        lora_name=lora_name,
        media=media,
        media_positions=media_positions,
    )
    return PromptKeys(hashes=chain.finish(), prompt_tokens=chain.prompt_tokens)


def prompt_chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: str | None = None,
    lora_name: str | None = None,
    media: Sequence[MediaInput] = (),
    media_positions: Sequence[int] | None = None,
) -> KeyChain:
    """Hash a prepared prompt the way :func:`event_block_keys` hashes what an engine stored,
    as far as asked (:class:`KeyChain`).

    Each image occupies one placeholder token at ``media_positions[i]``; vLLM expands it to
    ``media[i].num_tokens`` copies of that token id (or to ``media[i].expansion`` when known),
    and so does this function. Images whose position or size is unknown stop the hash at their
    placeholder: everything before it can still be matched.
    """
    seed = chain_seed(salt, lora_name)
    tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    if not media:
        return KeyChain(tokens, block_size, seed, None, len(tokens))
    expanded, spans, complete = _expand_images(tokens, media, media_positions)
    prompt_tokens = len(expanded) if complete else _expanded_length(tokens, media)
    images = _images_per_block(spans, block_size) if spans else None
    return KeyChain(expanded, block_size, seed, images, prompt_tokens)


def image_runs(
    positions: Sequence[int], prompt_len: int, expanded: Sequence[int]
) -> list[tuple[list[int], int]] | None:
    """The expanded size of each run of adjacent image placeholders, read from vLLM's
    expanded prompt: ``[(indices of the images in the run, tokens the run became)]``.

    Image ``i``'s placeholder sits at ``positions[i]`` of the prompt as sent (``prompt_len``
    tokens); vLLM replaces it by a run of the same token id, shifting what follows. Placeholders
    side by side merge into one run, so their split is not in the ids. None when the runs do not
    add up to ``expanded`` (a model whose expansion is not one run of its placeholder).
    """
    groups: list[tuple[list[int], int]] = []
    shift = 0
    index = 0
    while index < len(positions):
        members = [index]
        while index + 1 < len(positions) and positions[index + 1] == positions[index] + 1:
            index += 1
            members.append(index)
        start = positions[members[0]] + shift
        if not 0 <= start < len(expanded):
            return None
        token = expanded[start]
        end = start
        while end < len(expanded) and expanded[end] == token:
            end += 1
        groups.append((members, end - start))
        shift += end - start - len(members)
        index += 1
    if prompt_len + shift != len(expanded):
        return None
    return groups


def _expanded_length(tokens: tuple[int, ...], media: Sequence[MediaInput]) -> int:
    return len(tokens) + sum(max((item.num_tokens or 1) - 1, 0) for item in media)


def _expand_images(
    tokens: tuple[int, ...],
    media: Sequence[MediaInput],
    positions: Sequence[int] | None,
) -> tuple[tuple[int, ...], list[tuple[int, int, int]], bool]:
    """Expand each placeholder; returns (tokens, [(start, end, image key)], all known)."""
    if positions is None or len(positions) != len(media):
        return (), [], False
    out: list[int] = []
    spans: list[tuple[int, int, int]] = []
    cursor = 0
    for item, position in zip(media, positions, strict=True):
        if position < cursor or position >= len(tokens) or not item.num_tokens:
            out.extend(tokens[cursor : max(cursor, min(position, len(tokens)))])
            return tuple(out), spans, False
        out.extend(tokens[cursor:position])
        start = len(out)
        out.extend(item.expansion or (tokens[position],) * item.num_tokens)
        spans.append((start, len(out), text_key(item.uuid)))
        cursor = position + 1
    out.extend(tokens[cursor:])
    return tuple(out), spans, True


def _images_per_block(
    spans: Sequence[tuple[int, int, int]], block_size: int
) -> list[tuple[int, ...]]:
    last_end = spans[-1][1]
    per_block: list[list[int]] = [[] for _ in range((last_end + block_size - 1) // block_size)]
    for start, end, key in spans:
        for block in range(start // block_size, (end - 1) // block_size + 1):
            per_block[block].append(key)
    return [tuple(keys) for keys in per_block]


def event_block_keys(
    extra_keys: Sequence[object] | None, lora_name: str | None
) -> tuple[str | None, list[tuple[int, ...]] | None]:
    """Split vLLM's per-block ``extra_keys`` into (cache salt, image keys per block).

    Entries are strings (image identifiers, the LoRA name, the salt) or ``[identifier, offset]``
    pairs, depending on the vLLM build. Image identifiers may carry a ``"<lora>:"`` prefix when
    the adapter also touches the vision tower; it is stripped so they equal the uuid we sent.
    """
    if not extra_keys:
        return None, None
    salt: str | None = None
    per_block: list[tuple[int, ...]] = []
    any_image = False
    prefix = f"{lora_name}:" if lora_name else None
    for index, entry in enumerate(extra_keys):
        if not entry:
            per_block.append(())
            continue
        keys: list[int] = []
        for item in entry if isinstance(entry, list | tuple) else (entry,):
            identifier = item[0] if isinstance(item, list | tuple) and item else item
            if not isinstance(identifier, str):
                continue
            if identifier.startswith(SALT_TAG):
                if index == 0:
                    salt = identifier[len(SALT_TAG) :]
                continue
            if identifier == lora_name:
                continue
            if prefix and identifier.startswith(prefix):
                identifier = identifier[len(prefix) :]
            keys.append(text_key(identifier))
        if keys:
            any_image = True
        per_block.append(tuple(keys))
    return salt, per_block if any_image else None
