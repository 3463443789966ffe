"""Structured logs: every record as one JSON object or one text line, and the access log.

``--log-format json`` makes each line a JSON object (``ts``, ``level``, ``logger``, ``pid``,
``msg`` and any structured fields) that log shippers index without parsing rules; ``text``
keeps the human layout and appends the fields as ``key=value``. uvicorn's own loggers go
through the same handler. The access log writes one record per OpenAI request when it ends:
its id, endpoint, model, status, rank, token counts (cached tokens are the router's estimate
of the prompt prefix the rank already held) and timings in milliseconds.

A log line is one line, whatever a client put in the values it carries (a request id, a model
or LoRA name, a header): both formats escape control characters (C0, DEL, C1), Unicode line
separators and bidirectional overrides as backslash escapes, in the message and in every
field, and the text format quotes a field value with spaces, quotes or ``=`` so that no value
reads as another field.
"""

from __future__ import annotations

import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import orjson

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
ACCESS_LOGGER = "rankgate.access"
_TEXT_LAYOUT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NEEDS_QUOTES = re.compile(r'[\s"=]')


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(text: str) -> str:
    """``text`` with every character that could end, forge or hide part of a line escaped."""
    return text if _UNSAFE.search(text) is None else _UNSAFE.sub(_escape_char, text)


def _safe_value(value: Any) -> Any:
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, list | tuple):
        return [_safe_value(v) for v in value]
    return value


def _fields(record: logging.LogRecord) -> dict[str, Any] | None:
    fields: dict[str, Any] | None = getattr(record, "fields", None)
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": safe_text(record.getMessage()),
        }
        fields = _fields(record)
        if fields:
            payload.update((key, _safe_value(value)) for key, value in fields.items())
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(payload, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(_TEXT_LAYOUT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = safe_text(super().formatMessage(record))
        fields = _fields(record)
        if not fields:
            return line
        return line + "".join(f" {key}={_text(value)}" for key, value in fields.items())


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        text = ",".join("-" if v is None else str(v) for v in value)
    else:
        text = str(value)
    text = safe_text(text)
    if _NEEDS_QUOTES.search(text) is None:
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def configure_logging(level: str, log_format: str) -> None:
    """One stderr handler on the root logger, in ``log_format``; uvicorn's loggers propagate
    to it (start uvicorn with ``log_config=None``)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r}; choose from {LOG_FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


class FinishedRequest(Protocol):
    """What the access log reads of a finished request
    (``rankgate.app.observability.record.RequestRecord``)."""

    request_id: str
    endpoint: str
    model: str
    stream: bool
    rank: int | None
    ranks: list[int | None] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class AccessLog:
    """Writes one ``request`` record per finished OpenAI request to ``rankgate.access``."""

    __slots__ = ("_logger",)

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger(ACCESS_LOGGER)

    def request(
        self, record: FinishedRequest, status: int, total: float, queue: float, ttft: float
    ) -> None:
        logger = self._logger
        if not logger.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {
            "request_id": record.request_id,
            "endpoint": record.endpoint,
            "model": record.model,
            "status": status,
            "stream": record.stream,
            "rank": record.rank,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "cached_tokens": record.cached_tokens,
            "queue_ms": round(queue * 1000.0, 3),
            "ttft_ms": round(ttft * 1000.0, 3) if ttft else None,
            "total_ms": round(total * 1000.0, 3),
        }
        if record.ranks is not None:
            fields["ranks"] = record.ranks
        logger.info("request", extra={"fields": fields})
