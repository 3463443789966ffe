"""Validation of the KV-event publishers vLLM advertises (SPEC.md section 6).

An engine without KV events is normal (the router then routes on load alone); an engine that
advertises events must advertise exactly one usable ZMQ publisher per served rank, otherwise
the router would silently miss a rank's cache and mis-route. Wildcard bind addresses are only
meaningful on the engine's host, so they are rewritten to the host the gateway reached gRPC on.

vLLM's publisher binds only an endpoint with ``*`` or ``::`` in it, or an ipc/inproc one; any
other endpoint it connects to, so the gateway must bind there (``KvEventSource.bind``): that is
how an engine pushes its events to a gateway beside it (``tcp://127.0.0.1:P``). Its replay
ROUTER always binds, so replay endpoints are only ever rewritten.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from rankgate.sidecar.errors import DiscoveryError
from rankgate.sidecar.types import KvEventSource

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]", "::", "[::0]"})


def validate_kv_sources(
    sources: Iterable[Any], ranks: Sequence[int], grpc_host: str
) -> tuple[KvEventSource, ...]:
    """Return one validated source per rank, sorted by rank, or () when KV events are off.

    ``sources`` are ``vllm.KvEventSource`` messages; ``grpc_host`` is the unbracketed host.
    """
    served = set(ranks)
    by_rank: dict[int, KvEventSource] = {}
    for source in sources:
        transport = source.transport.strip().lower()
        if transport != "zmq":
            log.warning("skipping KV-event source with unsupported transport %r", source.transport)
            continue
        if not source.HasField("data_parallel_rank"):
            raise DiscoveryError(f"KV-event source {source.endpoint!r} names no data-parallel rank")
        rank = int(source.data_parallel_rank)
        if rank not in served:
            raise DiscoveryError(
                f"KV-event source for rank {rank} is outside the served ranks {sorted(served)}"
            )
        if rank in by_rank:
            raise DiscoveryError(f"two KV-event sources claim data-parallel rank {rank}")
        endpoint = source.endpoint.strip()
        if not endpoint:
            raise DiscoveryError(f"KV-event source for rank {rank} has an empty endpoint")
        replay = source.replay_endpoint.strip()
        binds = publisher_binds(endpoint)
        by_rank[rank] = KvEventSource(
            rank=rank,
            endpoint=rewrite_wildcard(endpoint, grpc_host) if binds else endpoint,
            replay_endpoint=rewrite_wildcard(replay, grpc_host) if replay else None,
            topic=source.topic,
            bind=not binds,
        )
    if not by_rank:
        return ()
    missing = sorted(served - by_rank.keys())
    if missing:
        raise DiscoveryError(f"no KV-event source for data-parallel ranks {missing}")
    return tuple(by_rank[rank] for rank in sorted(by_rank))


def publisher_binds(endpoint: str) -> bool:
    """Whether vLLM's ZMQ publisher binds ``endpoint`` (else it connects to it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def rewrite_wildcard(endpoint: str, grpc_host: str) -> str:
    """``tcp://*:5557`` → ``tcp://<grpc host>:5557``; other endpoints are returned unchanged."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme.lower() != "tcp":
        return endpoint
    host, colon, port = rest.rpartition(":")
    if not colon or host not in _WILDCARD_HOSTS:
        return endpoint
    target = f"[{grpc_host}]" if ":" in grpc_host else grpc_host
    return f"tcp://{target}:{port}"
