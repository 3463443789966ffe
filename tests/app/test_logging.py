"""The access log and ``X-Request-Id`` through HTTP: one structured line per request with its
id, rank, tokens, cached tokens, timings and status; ids taken, checked, made and returned."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import orjson
import pytest

from rankgate.app.access_log import ACCESS_LOGGER, JsonFormatter, TextFormatter
from rankgate.app.server import create_app
from rankgate.app.settings import GatewaySettings
from tests.app.serving import serve_app
from tests.support.engines import EngineUnderTest

FIELDS = {
    "request_id",
    "endpoint",
    "model",
    "status",
    "stream",
    "rank",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "queue_ms",
    "ttft_ms",
    "total_ms",
}


class Lines(logging.Handler):
    """The access log's records, rendered by the JSON formatter the CLI installs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def find(self, request_id: str) -> dict[str, object]:
        found = [
            orjson.loads(self.format(r))
            for r in self.records
            if getattr(r, "fields", {}).get("request_id") == request_id
        ]
        assert len(found) == 1, f"{len(found)} access lines for {request_id}"
        line: dict[str, object] = found[0]
        return line


@pytest.fixture(scope="module")
def logged_gateway(mock_vllm: EngineUnderTest) -> Iterator[str]:
    settings = GatewaySettings(
        engine=mock_vllm.target, tokenizer=str(mock_vllm.tokenizer_dir), access_log=True
    )
    with serve_app(create_app(settings)) as url:
        yield url


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def http(logged_gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=logged_gateway, timeout=30) as client:
        yield client


def _chat(model: str, text: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def test_one_line_per_request_with_its_story(
    mock_vllm: EngineUnderTest, http: httpx.Client, lines: Lines
) -> None:
    model = mock_vllm.served_model_name
    body = _chat(model, "tell the log", max_tokens=6, min_tokens=6)
    response = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-1"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-1"
    usage = response.json()["usage"]
    line = lines.find("trace-1")
    assert set(line) >= FIELDS
    assert line["msg"] == "request"
    assert line["logger"] == ACCESS_LOGGER
    assert line["level"] == "info"
    assert (line["endpoint"], line["model"], line["status"], line["stream"]) == (
        "chat",
        model,
        200,
        False,
    )
    assert line["rank"] in range(mock_vllm.dp_size)
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"] == 6
    assert line["cached_tokens"] == 0
    queue, total = line["queue_ms"], line["total_ms"]
    assert isinstance(queue, float)
    assert isinstance(total, float)
    assert 0 < queue <= total
    # A non-streamed answer arrives whole: no first-token time to report.
    assert line["ttft_ms"] is None


def test_a_stream_logs_its_ttft_and_a_repeat_its_cached_prefix(
    mock_vllm: EngineUnderTest, http: httpx.Client, lines: Lines
) -> None:
    model = mock_vllm.served_model_name
    # Several KV blocks of shared prefix, so the second request's rank is known to hold it.
    text = " ".join(f"word{i}" for i in range(120))
    ids = ("prefix-a", "prefix-b")
    for rid in ids:
        body = _chat(model, text, max_tokens=4, stream=True)
        with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
        ) as response:
            assert response.status_code == 200
            assert response.headers["x-request-id"] == rid
            assert response.read().endswith(b"data: [DONE]\n\n")
    first, second = (lines.find(rid) for rid in ids)
    for line in (first, second):
        assert line["stream"] is True
        ttft, total = line["ttft_ms"], line["total_ms"]
        assert isinstance(ttft, float)
        assert isinstance(total, float)
        assert 0 < ttft <= total
    prompt = second["prompt_tokens"]
    cached = second["cached_tokens"]
    assert isinstance(prompt, int)
    assert isinstance(cached, int)
    assert prompt > 2 * mock_vllm.block_size
    assert cached >= prompt - mock_vllm.block_size
    assert second["rank"] == first["rank"]


def test_refusals_are_logged_with_their_status(
    mock_vllm: EngineUnderTest, http: httpx.Client, lines: Lines
) -> None:
    response = http.post(
        "/v1/chat/completions",
        json=_chat("no-such-model", "hi"),
        headers={"X-Request-Id": "missing-model"},
    )
    assert response.status_code == 404
    assert response.headers["x-request-id"] == "missing-model"
    line = lines.find("missing-model")
    assert (line["status"], line["model"], line["rank"], line["completion_tokens"]) == (
        404,
        "",
        None,
        0,
    )


def test_request_ids_are_made_checked_and_taken_from_the_body(
    mock_vllm: EngineUnderTest, http: httpx.Client, lines: Lines
) -> None:
    model = mock_vllm.served_model_name
    made = http.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 1})
    assert made.status_code == 200
    rid = made.headers["x-request-id"]
    assert len(rid) == 24
    assert int(rid, 16) >= 0
    assert made.json()["id"] == f"cmpl-{rid}"
    lines.find(rid)

    for bad in ("has space", "x" * 129, 'quote"d', "semi;colon"):
        refused = http.post(
            "/v1/completions",
            json={"model": model, "prompt": "a", "max_tokens": 1},
            headers={"X-Request-Id": bad},
        )
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("x-request-id", "invalid_request_id")
        fresh = refused.headers["x-request-id"]
        assert fresh != bad
        assert len(fresh) == 24
        assert lines.find(fresh)["status"] == 400

    longest = "a.b_c:d@e/f+g=h-" + "z" * 112
    assert len(longest) == 128
    kept = http.post(
        "/v1/completions",
        json={"model": model, "prompt": "a", "max_tokens": 1},
        headers={"X-Request-Id": longest},
    )
    assert kept.headers["x-request-id"] == longest

    named = http.post(
        "/v1/completions",
        json={"model": model, "prompt": "a", "max_tokens": 1, "request_id": "from-body"},
    )
    assert named.headers["x-request-id"] == "from-body"
    assert named.json()["id"] == "cmpl-from-body"
    lines.find("from-body")


def test_text_lines_carry_the_fields_as_key_values() -> None:
    record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 1, "request", None, None)
    record.fields = {"request_id": "r1", "rank": None, "ranks": [0, None], "status": 200}
    line = TextFormatter().format(record)
    assert line.endswith("INFO rankgate.access: request request_id=r1 rank=- ranks=0,- status=200")
