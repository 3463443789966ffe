"""The access log and ``X-Request-Id`` through HTTP: one structured line per request with its
id, rank, tokens, cached tokens, timings and status; ids taken, checked, made and returned."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import orjson
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.observability.logs import ACCESS_LOGGER, JsonFormatter, TextFormatter
from rankgate.app.server import create_app
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


HOSTILE = "x\r\nFORGED level=error\x1b[2J\x00\x7f\x85\u2028\u202e end"
# What no formatted record may contain: any control character but the line's own end.
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


class Everything(logging.Handler):
    """Every record of every logger, kept to be formatted both ways."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_formatters_keep_every_record_on_one_safe_line() -> None:
    record = logging.LogRecord(
        "rankgate.sidecar", logging.WARNING, __file__, 1, "request %s: %s", (HOSTILE, 7), None
    )
    record.fields = {"request_id": HOSTILE, "model": 'a b="c"', "ranks": [HOSTILE, None]}
    text = TextFormatter().format(record)
    assert "\n" not in text
    assert not UNSAFE.search(text)
    assert "\\x0d\\x0aFORGED" in text
    # No field value reads as a field of its own.
    assert ' model="a b=\\"c\\""' in text
    assert ' request_id="x\\\\x0d' in text
    payload = orjson.loads(JsonFormatter().format(record))
    for value in (payload["msg"], payload["request_id"], payload["ranks"][0]):
        assert not UNSAFE.search(value)
        assert "\\x1b[2J" in value


def test_client_controlled_values_reach_logs_escaped(
    mock_vllm: EngineUnderTest, http: httpx.Client, lines: Lines
) -> None:
    """Control characters sent through every field a client names things with, in both log
    formats, at every level: no record renders them raw."""
    catcher = Everything()
    root = logging.getLogger()
    level = root.level
    root.addHandler(catcher)
    root.setLevel(logging.DEBUG)
    model = mock_vllm.served_model_name
    try:
        # An engine fault: the failure is logged with the engine request id, which a body's
        # request_id names.
        mock_vllm.mock.faults.garble_replies(1)
        failed = http.post(
            "/v1/completions",
            json={"model": model, "prompt": "a", "max_tokens": 1, "request_id": HOSTILE},
        )
        assert failed.status_code == 502
        for body in (
            _chat(HOSTILE, "hi"),
            _chat(model, "hi", request_id=HOSTILE, max_tokens=1),
            {"model": model, "prompt": "a", "max_tokens": 1, "request_id": HOSTILE},
            {"model": f"{model}:{HOSTILE}", "prompt": "a", "max_tokens": 1},
            {"model": model, "prompt": "a", "max_tokens": 1, "user": HOSTILE},
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            http.post(path, json=body)
        http.post("/v1/responses", json={"model": model, "input": "a", "request_id": HOSTILE})
        http.get(f"/v1/responses/resp_{quote(HOSTILE)}")
        http.get(f"/v1/models/{quote(HOSTILE)}")
    finally:
        mock_vllm.mock.faults.garble_replies(0)
        root.removeHandler(catcher)
        root.setLevel(level)
    assert catcher.records
    hostile_seen = False
    for record in catcher.records:
        for formatter in (TextFormatter(), JsonFormatter()):
            line = formatter.format(record)
            assert "\n" not in line or record.exc_info, line
            assert not UNSAFE.search(line), line
            hostile_seen |= "FORGED" in line and record.name.startswith("rankgate")
    assert hostile_seen, "the hostile values reached no log line at all: the test saw nothing"
