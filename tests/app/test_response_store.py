"""The stored-responses bounds: entries, bytes and time to live, oldest out first."""

from __future__ import annotations

import pytest

from rankgate.app.errors import ApiError
from rankgate.app.response_store import ResponseStore, StoreLimits
from rankgate.app.schemas.requests import AssistantMessage, UserMessage

TURN = (UserMessage(content="hi"), AssistantMessage(content="hello"))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_follow_up_gets_the_conversation_back() -> None:
    store = ResponseStore(StoreLimits())
    rid = store.new_id()
    assert store.put(rid, b'{"id":"x"}', TURN)
    assert store.body(rid) == b'{"id":"x"}'
    assert tuple(store.conversation(rid)) == TURN


def test_entries_bound_drops_the_oldest() -> None:
    store = ResponseStore(StoreLimits(max_entries=2))
    ids = [store.new_id() for _ in range(3)]
    for rid in ids:
        store.put(rid, b"{}", TURN)
    assert len(store) == 2
    with pytest.raises(ApiError) as caught:
        store.body(ids[0])
    assert caught.value.status == 404
    assert store.body(ids[2]) == b"{}"


def test_bytes_bound_counts_bodies_and_conversations() -> None:
    store = ResponseStore(StoreLimits(max_bytes=3000))
    big = b"x" * 1000
    ids = [store.new_id() for _ in range(4)]
    for rid in ids:
        store.put(rid, big, TURN)
    assert store.size <= 3000
    assert len(store) == 2
    assert not store.put(store.new_id(), b"y" * 4000, TURN)
    assert len(store) == 2


def test_entries_expire_after_their_time_to_live() -> None:
    clock = Clock()
    store = ResponseStore(StoreLimits(ttl_s=60), clock=clock)
    rid = store.new_id()
    store.put(rid, b"{}", TURN)
    clock.now += 59
    assert store.body(rid) == b"{}"
    clock.now += 2
    with pytest.raises(ApiError) as caught:
        store.conversation(rid)
    assert caught.value.code == "previous_response_not_found"
    assert len(store) == 0
    assert store.size == 0


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        StoreLimits(ttl_s=-1)
    store = ResponseStore(StoreLimits(max_entries=0))
    assert not store.put(store.new_id(), b"{}", TURN)


@pytest.mark.parametrize(
    ("stored", "asking", "visible"),
    [
        (None, None, True),
        (b"a" * 32, b"a" * 32, True),
        (b"a" * 32, b"b" * 32, False),
        (b"a" * 32, None, False),
        (None, b"a" * 32, False),
    ],
)
def test_an_entry_is_visible_only_to_its_owner(
    stored: bytes | None, asking: bytes | None, visible: bool
) -> None:
    store = ResponseStore(StoreLimits())
    rid = store.new_id()
    store.put(rid, b"{}", TURN, stored)
    if not visible:
        for call in (store.body, store.conversation, store.delete):
            with pytest.raises(ApiError) as refused:
                call(rid, asking)
            assert refused.value.status == 404
        assert len(store) == 1
        return
    assert store.body(rid, asking) == b"{}"
    assert tuple(store.conversation(rid, asking)) == TURN
    store.delete(rid, asking)
    assert len(store) == 0
