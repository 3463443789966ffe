"""Stored responses (``store: true``), for ``previous_response_id`` and ``GET/DELETE
/v1/responses/{id}``: in memory, in this process, bounded in entries, bytes and age.

Each entry keeps the response body as the client got it and the conversation it ended
(earlier turns, this turn's input and its output, as chat messages), both as encoded bytes,
so an entry's size is known exactly and nothing stored can change. Entries leave oldest
first, when any bound is reached or their time to live is over.

An entry belongs to the tenant (API key) that stored it: asked for by any other tenant it is
not there, with the same 404 as an id never issued, so ids cannot be probed across tenants.

A response id carries the tag of the process that made it. With ``--workers`` each worker
has its own store, and a follow-up that reaches another worker is refused with a 404 that
says so (``code: response_on_other_worker``) rather than served without its history.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from rankgate.app.errors import response_not_found
from rankgate.app.schemas.requests import Message

log = logging.getLogger(__name__)

ID_PREFIX = "resp_"
_TAG_LEN = 6
_MESSAGES = msgspec.json.Decoder(list[Message])
_ENCODER = msgspec.json.Encoder()
# What an entry costs besides its two byte strings (key, record, dict slot), roughly.
_ENTRY_OVERHEAD = 256


@dataclass(frozen=True, slots=True)
class StoreLimits:
    max_entries: int = 4096
    max_bytes: int = 256 << 20
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_entries < 0 or self.max_bytes < 0 or self.ttl_s < 0:
            raise ValueError("response store limits must be >= 0 (0 stores nothing)")


@dataclass(frozen=True, slots=True)
class _Entry:
    body: bytes
    conversation: bytes
    expires: float
    owner: bytes | None
    # The id of the chain's first response: the conversation's routing affinity key.
    chain: str | None = None

    @property
    def size(self) -> int:
        return len(self.body) + len(self.conversation) + len(self.chain or "") + _ENTRY_OVERHEAD


class ResponseStore:
    def __init__(
        self,
        limits: StoreLimits,
        *,
        workers: int = 1,
        tag: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._workers = workers
        self._tag = tag or os.urandom(_TAG_LEN // 2).hex()
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        return self._bytes

    def new_id(self) -> str:
        return ID_PREFIX + self._tag + os.urandom(12).hex()

    def put(
        self,
        response_id: str,
        body: bytes,
        conversation: tuple[Message, ...],
        owner: bytes | None = None,
        chain: str | None = None,
    ) -> bool:
        """Keep a finished response for ``owner``; False when it alone exceeds the bounds.
        ``chain`` is the id of the first response of the conversation it continues."""
        limits = self.limits
        expires = self._clock() + limits.ttl_s
        entry = _Entry(body, _ENCODER.encode(conversation), expires, owner, chain)
        if limits.max_entries == 0 or entry.size > limits.max_bytes:
            log.debug("response %s (%d bytes) is too large to store", response_id, entry.size)
            return False
        self._drop(response_id)
        self._entries[response_id] = entry
        self._bytes += entry.size
        self._evict()
        return True

    def body(self, response_id: str, owner: bytes | None = None) -> bytes:
        return self._get(response_id, owner, "response_id").body

    def conversation(self, response_id: str, owner: bytes | None = None) -> list[Message]:
        entry = self._get(response_id, owner, "previous_response_id")
        return _MESSAGES.decode(entry.conversation)

    def chain(self, response_id: str, owner: bytes | None = None) -> str | None:
        """The id of the first response of the conversation ``response_id`` belongs to."""
        return self._get(response_id, owner, "previous_response_id").chain

    def delete(self, response_id: str, owner: bytes | None = None) -> None:
        self._get(response_id, owner, "response_id")
        self._drop(response_id)

    def _get(self, response_id: str, owner: bytes | None, param: str) -> _Entry:
        self._evict()
        entry = self._entries.get(response_id)
        if entry is None or not _same_owner(entry.owner, owner):
            raise response_not_found(response_id, param, self._elsewhere(response_id))
        return entry

    def _elsewhere(self, response_id: str) -> int | None:
        """The worker count, when ``response_id`` was made by another live-looking worker."""
        if self._workers <= 1 or not response_id.startswith(ID_PREFIX):
            return None
        tag = response_id[len(ID_PREFIX) : len(ID_PREFIX) + _TAG_LEN]
        return self._workers if tag != self._tag else None

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size

    def _evict(self) -> None:
        limits = self.limits
        entries = self._entries
        now = self._clock()
        while entries:
            oldest_id, oldest = next(iter(entries.items()))
            if (
                len(entries) <= limits.max_entries
                and self._bytes <= limits.max_bytes
                and oldest.expires > now
            ):
                return
            self._drop(oldest_id)


def _same_owner(stored: bytes | None, asking: bytes | None) -> bool:
    if stored is None or asking is None:
        return stored is asking
    return hmac.compare_digest(stored, asking)
