"""``GET /v1/models`` and ``GET /v1/models/{model}``: served name, aliases and LoRA adapters."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from rankgate.app.errors import model_not_found
from rankgate.app.routes.common import gateway_of
from rankgate.app.schemas.openapi import json_response
from rankgate.app.schemas.responses import ModelList, ModelObject
from rankgate.app.state import state_of

router = APIRouter()
_ENCODER = msgspec.json.Encoder()
# A bare `rankgate serve` answers with the bundled mock engine; its models say so.
DEMO_OWNER = "rankgate-demo (bundled mock engine, made-up text; start with --engine for vLLM)"


async def _objects(request: Request) -> list[ModelObject]:
    gateway = gateway_of(request)
    state = state_of(request)
    created = state.started_at
    max_len = gateway.engine.info.max_model_len
    owner = DEMO_OWNER if state.demo else "rankgate"
    return [
        ModelObject(
            id=card.id,
            created=created,
            owned_by=owner,
            root=card.root,
            parent=card.parent,
            max_model_len=max_len,
        )
        for card in await gateway.models.cards()
    ]


@router.get("/v1/models", response_class=Response, responses=json_response("ModelList"))
async def list_models(request: Request) -> Response:
    body = _ENCODER.encode(ModelList(data=await _objects(request)))
    return Response(body, media_type="application/json")


@router.get(
    "/v1/models/{model:path}", response_class=Response, responses=json_response("ModelObject")
)
async def retrieve_model(request: Request, model: str) -> Response:
    for item in await _objects(request):
        if item.id == model:
            return Response(_ENCODER.encode(item), media_type="application/json")
    raise model_not_found(model)
