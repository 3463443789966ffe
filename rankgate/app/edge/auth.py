"""API keys: ``Authorization: Bearer <key>`` on every ``/v1`` route, ``/tokenize`` and
``/detokenize``, optionally on /metrics.

With keys set, the API's description (``/openapi.json``, ``/docs``) needs one too unless
``--no-protect-docs`` opens it. Keys can come from ``RANKGATE_API_KEY`` or a file
(``--api-key-file``), so that they need not appear on a command line.

Keys are kept only as SHA-256 digests and every presented key is compared against every
configured one with :func:`hmac.compare_digest`, so neither the comparison's timing nor its
length reveals which key, or which prefix of one, was close. Keys never appear in logs, reprs
or error messages. /health and /ready stay open: orchestrators probe them without secrets.

Each key is also a tenant: the middleware puts the matched key's digest in the request's
state (:func:`tenant_of`), and what a request stores for later (stored responses) is visible
only to requests of the same tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from rankgate.app.errors import ApiError

API_KEY_ENV = "RANKGATE_API_KEY"
_BEARER = b"bearer "
_TENANT = "rankgate_tenant"
# vLLM serves these open; here they cost what generation's preparation costs, so they need a
# key like /v1 does.
_TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})


@dataclass(frozen=True, slots=True)
class AccessConfig:
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    protect_metrics: bool = False
    # The API's description (/openapi.json, /docs) needs a key too, when keys are set.
    protect_docs: bool = True
    # Browser origins allowed by CORS; empty turns CORS off (no CORS headers at all).
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if not key or key != key.strip() or any(c in key for c in "\r\n\t "):
                raise ValueError("an API key must be non-empty and contain no whitespace")


def load_keys(flags: list[str] | None, key_file: str | None) -> tuple[str, ...]:
    """Keys from ``--api-key`` (repeatable), ``RANKGATE_API_KEY`` (comma-separated) and a file
    with one key per line (``#`` starts a comment), in that order, without duplicates."""
    keys: list[str] = list(flags or ())
    env = os.environ.get(API_KEY_ENV, "")
    keys.extend(part.strip() for part in env.split(",") if part.strip())
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            text = line.split("#", 1)[0].strip()
            if text:
                keys.append(text)
    return tuple(dict.fromkeys(keys))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


_MISSING = ApiError(
    401,
    "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
    code="missing_api_key",
)
_WRONG = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
_CHALLENGE = [(b"www-authenticate", b"Bearer")]


class ApiKeyAuth:
    """ASGI middleware; installed only when keys are configured, so it costs nothing otherwise."""

    def __init__(self, app: ASGIApp, config: AccessConfig) -> None:
        if not config.api_keys:
            raise ValueError("ApiKeyAuth needs at least one key")
        self.app = app
        self._digests = tuple(_digest(key.encode()) for key in config.api_keys)
        self._metrics = config.protect_metrics
        self._docs = config.protect_docs

    def protects(self, path: str) -> bool:
        return (
            path.startswith("/v1/")
            or path == "/v1"
            or path in _TOKENIZER_PATHS
            or (self._metrics and path == "/metrics")
            or (self._docs and (path == "/openapi.json" or path.startswith("/docs")))
        )

    def allowed(self, header: bytes | None) -> bool:
        return self.tenant(header) is not None

    def tenant(self, header: bytes | None) -> bytes | None:
        """The digest of the configured key ``header`` presents, or None. Every key is
        compared, whichever matches, so the time taken does not say which one did."""
        if header is None or header[:7].lower() != _BEARER:
            return None
        presented = _digest(header[7:].strip())
        match: bytes | None = None
        for digest in self._digests:
            if hmac.compare_digest(presented, digest):
                match = digest
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protects(scope["path"]):
            await self.app(scope, receive, send)
            return
        header: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        tenant = self.tenant(header)
        if tenant is not None:
            scope.setdefault("state", {})[_TENANT] = tenant
            await self.app(scope, receive, send)
            return
        body = (_MISSING if header is None else _WRONG).body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *_CHALLENGE,
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def tenant_of(scope: Scope) -> bytes | None:
    """The tenant (its key's digest) a request was admitted as; None when no keys are set."""
    state = scope.get("state")
    return None if state is None else state.get(_TENANT)


def install_access(app: FastAPI, config: AccessConfig) -> None:
    """API-key checks, then CORS outside them so that preflights (which carry no key) pass."""
    if config.api_keys:
        app.add_middleware(ApiKeyAuth, config=config)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type", "x-request-id", "x-data-parallel-rank"],
            expose_headers=["retry-after", "x-request-id"],
            max_age=600,
        )
