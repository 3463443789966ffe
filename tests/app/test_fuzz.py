"""Property-based and schema-driven fuzzing through HTTP: no input may produce a 5xx or hang.

schemathesis generates valid and invalid requests for every operation of our own
/openapi.json against a gateway in front of the mock engine (the real sidecar path), and
hypothesis throws request-shaped JSON (known fields with values of any type, unknown fields)
and raw bytes at the two request parsers. Both run a fixed, derandomized number of examples
so CI is deterministic and bounded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from app.schemas.requests import ChatCompletionRequest, CompletionRequest
from tests.app.scripted import SCRIPTED_MODEL

pytestmark = pytest.mark.timeout(240)
EXAMPLES = {GenerationMode.POSITIVE: 20, GenerationMode.NEGATIVE: 20}
PARSER_EXAMPLES = 150
_BASE = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def fuzz(examples: int) -> settings:
    return settings(_BASE, max_examples=examples)


CASES = {"schemathesis": 0, "parsers": 0}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def _fields(struct: type[msgspec.Struct]) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(struct)]


@pytest.fixture(scope="module")
def mock_http(mock_gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mock_gateway, timeout=60) as client:
        yield client


def test_schemathesis_finds_no_5xx(mock_gateway: str) -> None:
    schema = schemathesis.openapi.from_url(f"{mock_gateway}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    for operation in operations:
        for mode, count in EXAMPLES.items():
            strategy = operation.as_strategy(generation_mode=mode)

            @fuzz(count)
            @given(case=strategy)
            def run(case: Any) -> None:
                CASES["schemathesis"] += 1
                response = case.call(base_url=mock_gateway, timeout=30)
                assert response.status_code < 500, (
                    f"{case.method} {case.formatted_path} {case.body!r}: "
                    f"{response.status_code} {response.text[:300]}"
                )

            try:
                run()
            except Unsatisfiable:
                # Nothing to make invalid (a GET without parameters): only positive cases.
                assert mode is GenerationMode.NEGATIVE, operation.path
    print(f"\nschemathesis cases run: {CASES['schemathesis']}")
    assert CASES["schemathesis"] >= 80


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"]
        assert error["type"]


@fuzz(PARSER_EXAMPLES)
@given(
    fields=st.dictionaries(
        st.sampled_from([*_fields(ChatCompletionRequest), "frobnicate"]), json_values, max_size=5
    ),
    content=st.one_of(st.text(max_size=60), json_values),
)
def test_chat_parser_answers_every_shape_with_a_4xx_or_an_answer(
    scripted_http: httpx.Client, fields: dict[str, Any], content: Any
) -> None:
    CASES["parsers"] += 1
    body = {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **fields,
    }
    _check(scripted_http.post("/v1/chat/completions", content=json.dumps(body).encode()))


@fuzz(PARSER_EXAMPLES)
@given(
    fields=st.dictionaries(
        st.sampled_from([*_fields(CompletionRequest), "frobnicate"]), json_values, max_size=5
    ),
)
def test_completion_parser_answers_every_shape_with_a_4xx_or_an_answer(
    scripted_http: httpx.Client, fields: dict[str, Any]
) -> None:
    CASES["parsers"] += 1
    body = {"model": SCRIPTED_MODEL, "prompt": "hi", "max_tokens": 4, **fields}
    _check(scripted_http.post("/v1/completions", content=json.dumps(body).encode()))


@fuzz(PARSER_EXAMPLES)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_raw_bytes_are_a_4xx(scripted_http: httpx.Client, raw: bytes) -> None:
    CASES["parsers"] += 1
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = scripted_http.post(path, content=raw)
        assert 400 <= response.status_code < 500, response.text[:300]


def test_fuzz_case_count_report() -> None:
    print(f"\nfuzz cases run: schemathesis {CASES['schemathesis']}, parsers {CASES['parsers']}")
