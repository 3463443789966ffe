"""The conversation a request names, as the router's affinity key.

Three sources, the operator's first: the header ``--affinity-header`` names (a session id an
agent framework or a load balancer already sends), OpenAI's ``prompt_cache_key``, and for the
Responses API the chain a ``previous_response_id`` continues. Keys are scoped to the tenant
(the API key), so one tenant's key never steers another's conversation, and bounded in length.
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request

from rankgate.app.edge.auth import tenant_of
from rankgate.app.edge.headers import request_header
from rankgate.app.state import state_of

# Longer keys are hashed: the router's table holds many, and a key is an identity, not text.
_MAX_KEY = 128


def affinity_key(
    request: Request, prompt_cache_key: str | None, chain: str | None = None
) -> str | None:
    """The request's affinity key, or None when it names no conversation."""
    header = state_of(request).affinity_header
    name = request_header(request, header) if header else None
    key = name or prompt_cache_key or chain
    if not key:
        return None
    tenant = tenant_of(request)
    scoped = f"{tenant.hex()}:{key}" if tenant else f":{key}"
    if len(scoped) > _MAX_KEY:
        digest = hashlib.blake2b(scoped.encode("utf-8", "surrogatepass"), digest_size=16)
        return digest.hexdigest()
    return scoped
