"""Identical conversations share one render; the cache is bounded and never serves a template
that reads the clock."""

from __future__ import annotations

import httpx
import pytest

from rankgate.app.prepare import prompt_cache
from rankgate.app.prepare.prompt_cache import PromptCache
from rankgate.app.prepare.template import ChatTemplate
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine
from tests.app.test_template import TEMPLATES


def test_entries_and_bytes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = PromptCache(max_entries=4, max_bytes=200)
    for i in range(10):
        cache.put(f"key-{i}".encode(), (i,) * 3)
        assert len(cache) <= 4
    assert cache.get(b"key-9") == (9, 9, 9)
    assert cache.get(b"key-0") is None
    cache.put(b"big", tuple(range(30)))  # 243 bytes: more than the whole budget
    assert cache.get(b"big") is None
    monkeypatch.setattr(prompt_cache, "MAX_KEY_BYTES", 8)
    cache.put(b"a-very-long-key", (1,))
    assert cache.get(b"a-very-long-key") is None


def test_the_least_recently_used_goes_first() -> None:
    cache = PromptCache(max_entries=2)
    cache.put(b"a", (1,))
    cache.put(b"b", (2,))
    assert cache.get(b"a") == (1,)
    cache.put(b"c", (3,))
    assert cache.get(b"b") is None
    assert cache.get(b"a") == (1,)


@pytest.mark.parametrize(
    ("source", "deterministic"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", True),
        ((TEMPLATES / "llama3.jinja").read_text(), True),
        ("{{ strftime_now('%d %b %Y') }}{{ messages[0].content }}", False),
        ("{{ ['a', 'b'] | random }}", False),
        ("{{ lipsum(1) }}", False),
    ],
)
def test_templates_that_read_the_clock_are_not_cached(source: str, deterministic: bool) -> None:
    assert ChatTemplate(source).deterministic is deterministic


def test_repeated_and_changed_conversations_through_http(
    scripted_http: httpx.Client, scripted: ScriptedEngine
) -> None:
    def prompt(messages: list[dict[str, str]], **extra: object) -> tuple[int, ...]:
        body = {"model": SCRIPTED_MODEL, "messages": messages, **extra}
        response = scripted_http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return scripted.requests[-1].prompt_token_ids

    hello = [{"role": "user", "content": "Hello cache"}]
    first = prompt(hello)
    assert prompt(hello) == first
    # Anything the render reads changes the key.
    assert prompt([{"role": "user", "content": "Hello cache!"}]) != first
    assert prompt(hello, add_generation_prompt=False) != first
    assert prompt(hello, truncate_prompt_tokens=3) == first[-3:]
    assert prompt(hello) == first
