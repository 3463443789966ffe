"""The conversation a request names, as the router's affinity key.

Three sources, the operator's first: the header ``--affinity-header`` names (a session id an
agent framework or a load balancer already sends), OpenAI's ``prompt_cache_key``, and for the
Responses API the chain a ``previous_response_id`` continues. Keys are scoped to the tenant
(the API key), so one tenant's key never steers another's conversation, and bounded in length.
"""

from __future__ import annotations

import hashlib

from rankgate.app.edge.head import RequestHead

# Longer keys are hashed: the router's table holds many, and a key is an identity, not text.
_MAX_KEY = 128


def affinity_key(
    head: RequestHead, prompt_cache_key: str | None, chain: str | None = None
) -> str | None:
    """The request's affinity key, or None when it names no conversation."""
    key = head.session or prompt_cache_key or chain
    if not key:
        return None
    tenant = head.tenant
    scoped = f"{tenant.hex()}:{key}" if tenant else f":{key}"
    if len(scoped) > _MAX_KEY:
        digest = hashlib.blake2b(scoped.encode("utf-8", "surrogatepass"), digest_size=16)
        return digest.hexdigest()
    return scoped
