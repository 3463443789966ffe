"""The token ids of conversations seen lately, so an identical one skips render and tokenizer.

Rendering a chat template is a pure function of the conversation, the tools, the template
arguments and the special tokens, so an identical request (a retried call, the same prompt
sent by many clients, a load test) has identical prompt ids. The key is the conversation's
canonical JSON; a template that reads the clock or a random source is never cached (see
``ChatTemplate.deterministic``). Both entries and their total size are bounded, oldest out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_ENTRIES = 1024
# Keys and ids together (bytes of key plus 8 per id); about what 1024 short chats take.
MAX_BYTES = 16 << 20
# Conversations whose key is longer than this are not kept (they would crowd out the rest).
MAX_KEY_BYTES = 64 << 10


class PromptCache:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[int, ...] | None:
        ids = self._entries.get(key)
        if ids is not None:
            try:  # noqa: SIM105 (cheaper than contextlib.suppress per lookup)
                self._entries.move_to_end(key)
            except KeyError:
                pass  # evicted by another thread just now
        return ids

    def put(self, key: bytes, ids: tuple[int, ...]) -> None:
        if len(key) > MAX_KEY_BYTES:
            return
        size = len(key) + 8 * len(ids)
        with self._lock:
            entries = self._entries
            if key in entries:
                return
            entries[key] = ids
            self._bytes += size
            while len(entries) > self._max_entries or self._bytes > self._max_bytes:
                old_key, old_ids = entries.popitem(last=False)
                self._bytes -= len(old_key) + 8 * len(old_ids)
