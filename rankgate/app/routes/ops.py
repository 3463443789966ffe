"""Operations endpoints: liveness, readiness, Prometheus metrics and version."""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from rankgate import __version__
from rankgate.app.schemas.openapi import json_response
from rankgate.app.schemas.responses import Health, Readiness, Version
from rankgate.app.state import state_of

router = APIRouter()
_ENCODER = msgspec.json.Encoder()
_JSON = "application/json"


@router.get("/health", response_class=Response, responses=json_response("Health"))
async def health() -> Response:
    """The process is alive (says nothing about the engine; see /ready)."""
    return Response(_ENCODER.encode(Health(status="ok")), media_type=_JSON)


@router.get(
    "/ready",
    response_class=Response,
    responses={
        **json_response("Readiness", "The engine is discovered and healthy"),
        503: {
            "description": "Not ready",
            "content": {_JSON: {"schema": {"$ref": "#/components/schemas/Readiness"}}},
        },
    },
)
async def ready(request: Request) -> Response:
    state = state_of(request)
    gateway = state.gateway
    if gateway is None or not gateway.engine.ready or state.shutdown.draining:
        body = Readiness(ready=False, model=None, engine_version=None, dp_size=None)
        return Response(_ENCODER.encode(body), 503, {"Retry-After": "1"}, media_type=_JSON)
    info = gateway.engine.info
    body = Readiness(
        ready=True,
        model=info.served_model_name,
        engine_version=info.engine_version,
        dp_size=info.dp_size,
    )
    return Response(_ENCODER.encode(body), media_type=_JSON)


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    gateway_metrics = state_of(request).metrics
    if gateway_metrics.multiproc_dir is None:
        body, content_type = gateway_metrics.exposition()
    else:
        # Merging every worker's files reads from disk: off the event loop.
        body, content_type = await asyncio.to_thread(gateway_metrics.exposition)
    return Response(body, media_type=content_type)


@router.get("/version", response_class=Response, responses=json_response("Version"))
async def version(request: Request) -> Response:
    gateway = state_of(request).gateway
    engine_version = None
    if gateway is not None and gateway.engine.ready:
        engine_version = gateway.engine.info.engine_version
    body = Version(version=__version__, engine_version=engine_version)
    return Response(_ENCODER.encode(body), media_type=_JSON)
