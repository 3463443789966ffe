"""The JSON shape scan against a byte-at-a-time reference, on documents and on hostile text.

The reference walks the text one byte at a time with the scan's own rules (a quote after an
odd run of backslashes is not a delimiter; brackets, commas and colons count only outside
strings), so any chunking or vector-arithmetic mistake shows up as a difference. Chunks are
made tiny for the chunk-boundary cases.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rankgate.app.edge.json_shape as json_shape_module
from rankgate.app.edge.json_shape import JsonShape, could_exceed, json_shape

_FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=300,
    suppress_health_check=list(HealthCheck),
)


def reference(text: bytes) -> JsonShape:
    depth = deepest = containers = items = 0
    inside = False
    run = 0
    for byte in text:
        if byte == 0x5C:
            items += 1
            run += 1
            continue
        escaped, run = run % 2 == 1, 0
        if byte == 0x22 and not escaped:
            inside = not inside
        elif inside:
            continue
        elif byte in b"[{":
            depth += 1
            containers += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
        elif byte in b",:":
            items += 1
    return JsonShape(depth=deepest, containers=containers, items=items)


def nesting(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((nesting(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((nesting(v) for v in value), default=0)
    return 0


texts = st.text(alphabet='[]{}":,\\ab é\n', max_size=40)
documents = st.recursive(
    st.none() | st.booleans() | st.integers() | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=30,
)


@pytest.fixture(params=[1 << 20, 7, 1], ids=["default-chunks", "7-byte-chunks", "1-byte-chunks"])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(json_shape_module, "_CHUNK", request.param)
    return int(request.param)


@_FUZZ
@given(document=documents, ascii_only=st.booleans())
def test_the_depth_of_a_document_is_its_nesting(
    chunk: int, document: Any, ascii_only: bool
) -> None:
    text = json.dumps(document, ensure_ascii=ascii_only).encode()
    shape = json_shape(text)
    assert shape == reference(text)
    assert shape.depth == nesting(document)


@_FUZZ
@given(raw=st.binary(max_size=120) | st.text(alphabet='[]{}",:\\\\x', max_size=120).map(str.encode))
def test_any_text_is_measured_like_the_reference(chunk: int, raw: bytes) -> None:
    assert json_shape(raw) == reference(raw)


def test_runs_of_backslashes_decide_which_quotes_close_strings(chunk: int) -> None:
    # Two backslashes: an escaped backslash, so the quote closes the string and [ counts.
    assert json_shape(b'["a\\\\"[1]]').depth == 2
    # Three: the quote is escaped, the string goes on, the bracket is text.
    assert json_shape(b'["a\\\\\\"[1]"]').depth == 1
    # A run of backslashes longer than a chunk, then a quote.
    assert json_shape(b'["' + b"\\" * 9 + b'"[["]').depth == 1
    assert json_shape(b'["' + b"\\" * 10 + b'"[[]]]').depth == 3


def test_the_scan_stops_at_the_first_chunk_past_a_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_shape_module, "_CHUNK", 1024)
    text = b"[" + b"[]," * 100_000 + b"[]]"
    full = json_shape(text)
    assert full.containers == 100_002
    stopped = json_shape(text, container_limit=1000)
    assert 1000 < stopped.containers < 2000


def test_bracket_runs_then_an_unterminated_escaped_string_take_linear_time() -> None:
    """The input that made the old string regex quadratic (issue 18): 60 KB took 24.5 s."""
    small = b'{"a":' + b"[" * 100 + b'"' + b'\\"' * 30_000
    large = b'{"a":' + b"[" * 100 + b'"' + b'\\"' * 3_000_000
    started = time.perf_counter()
    assert json_shape(small).depth == 101
    assert json_shape(large).depth == 101
    # A hundred times the input in well under a second: nothing quadratic left.
    assert time.perf_counter() - started < 2.0


def test_could_exceed_is_false_only_when_no_limit_can_be_passed() -> None:
    assert not could_exceed(b'{"a":[1,2]}', depth=2, containers=16, items=1024)
    assert could_exceed(b'{"a":[[1]]}', depth=2, containers=16, items=1024)
    assert could_exceed(b"1" * 2000, depth=2, containers=16, items=1024)
