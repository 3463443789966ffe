"""One rank's KV blocks: allocation, a block-level prefix cache and LRU eviction.

Blocks are identified the way vLLM identifies them: a chained hash of the parent block's hash,
the block's token ids and its extra keys (LoRA name, image identifiers, cache salt on the first
block), so salted, LoRA and multimodal prompts never share blocks with plain ones. Free cached
blocks stay reusable until allocation pressure evicts the least recently used one; each
change is reported as a vLLM KV event.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rankgate.mocker.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

_HASH_MASK = (1 << 63) - 1
# Per block, as vLLM 0.32 publishes them: the LoRA name, then ``(image id, offset of the
# image's first token from the block's start)`` for each image the block touches (negative when
# the image began in an earlier block), then the cache salt in the first block.
ExtraKey = str | tuple[str, int]
ExtraKeys = tuple[ExtraKey, ...] | None


def block_hash(parent: int | None, tokens: Sequence[int], extra: ExtraKeys) -> int:
    """Chained block identity; fits a signed 64-bit integer as vLLM's external hashes do."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((parent or 0).to_bytes(8, "little"))
    digest.update(array("I", tokens).tobytes())
    if extra:
        digest.update(
            "\x1f".join(
                key if isinstance(key, str) else f"{key[0]}@{key[1]}" for key in extra
            ).encode()
        )
    return int.from_bytes(digest.digest(), "little") & _HASH_MASK


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref: int = 0
    hash: int | None = None


class PrefixCache:
    """Fixed pool of ``num_blocks`` blocks with prefix reuse; events accumulate in ``events``.

    As in vLLM's block pool, the first block is the null block, which never holds KV: a rank
    configured with N blocks caches at most N - 1.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[Block] = deque(Block(i) for i in range(1, num_blocks))
        # Cached blocks nobody references, oldest first: the eviction order.
        self._evictable: OrderedDict[int, Block] = OrderedDict()
        self._cached: dict[int, Block] = {}
        self.events: list[KvEvent] = []
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def is_cached(self, block_hash_value: int) -> bool:
        return block_hash_value in self._cached

    def match(self, hashes: Sequence[int]) -> list[Block]:
        """The longest run of leading blocks already cached."""
        found: list[Block] = []
        for value in hashes:
            block = self._cached.get(value)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.ref == 0 and block.hash is not None:
                self._evictable.pop(block.hash, None)
            block.ref += 1

    def allocate(self, count: int) -> list[Block] | None:
        """Take ``count`` blocks, evicting least recently used cached ones; None if short."""
        if count > self.num_free:
            return None
        taken: list[Block] = []
        removed: list[int] = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                value, block = self._evictable.popitem(last=False)
                del self._cached[value]
                removed.append(value)
                block.hash = None
            block.ref = 1
            taken.append(block)
        if removed:
            self.evictions += len(removed)
            self.events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_GPU))
        return taken

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference each; in reverse so a prompt's tail is evicted before its head."""
        for block in reversed(blocks):
            block.ref -= 1
            if block.ref > 0:
                continue
            if block.hash is not None:
                self._evictable[block.hash] = block
            else:
                self._free.append(block)

    def commit(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[int],
        parent: int | None,
        tokens: Sequence[int],
        extra_keys: Sequence[ExtraKeys],
        lora_name: str | None,
    ) -> None:
        """Publish newly full blocks; a hash some other block already holds is not stored twice."""
        stored_hashes: list[int] = []
        stored_tokens: list[int] = []
        stored_extra: list[list[Any] | None] = []
        stored_parent = parent
        size = self.block_size
        for index, (block, value) in enumerate(zip(blocks, hashes, strict=True)):
            if value in self._cached or block.hash is not None:
                if stored_hashes:
                    self._emit(stored_hashes, stored_parent, stored_tokens, stored_extra, lora_name)
                    stored_hashes, stored_tokens, stored_extra = [], [], []
                stored_parent = value
                continue
            block.hash = value
            self._cached[value] = block
            stored_hashes.append(value)
            stored_tokens.extend(tokens[index * size : (index + 1) * size])
            extra = extra_keys[index]
            stored_extra.append(list(extra) if extra else None)
        if stored_hashes:
            self._emit(stored_hashes, stored_parent, stored_tokens, stored_extra, lora_name)

    def clear(self) -> None:
        """Forget every unreferenced cached block (vLLM's reset_prefix_cache)."""
        for value, block in list(self._evictable.items()):
            del self._cached[value]
            block.hash = None
            self._free.append(block)
        self._evictable.clear()
        self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    def _emit(
        self,
        hashes: list[int],
        parent: int | None,
        tokens: list[int],
        extra: list[list[Any] | None],
        lora_name: str | None,
    ) -> None:
        self.events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=lora_name,
                extra_keys=extra,
            )
        )
