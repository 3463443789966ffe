"""Operations endpoints and the OpenAPI document, over HTTP."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rankgate import __version__
from rankgate.app.schemas.requests import ChatCompletionRequest, CompletionRequest
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine


def test_health_ready_version(scripted: ScriptedEngine, scripted_http: httpx.Client) -> None:
    assert scripted_http.get("/health").json() == {"status": "ok"}
    ready = scripted_http.get("/ready")
    assert ready.status_code == 200
    assert ready.json() == {
        "ready": True,
        "model": SCRIPTED_MODEL,
        "engine_version": "0.32.0",
        "dp_size": 2,
    }
    assert scripted_http.get("/version").json() == {
        "version": __version__,
        "engine_version": "0.32.0",
    }
    scripted.ready = False
    try:
        down = scripted_http.get("/ready")
        assert down.status_code == 503
        assert down.headers["retry-after"] == "1"
        assert scripted_http.get("/health").status_code == 200
    finally:
        scripted.ready = True


def test_metrics_count_requests(scripted: ScriptedEngine, scripted_http: httpx.Client) -> None:
    def count(status: str) -> float:
        text = scripted_http.get("/metrics").text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "rankgate_http_requests_total"
            and sample.labels["endpoint"] == "chat"
            and sample.labels["status"] == status
        )

    ok, bad = count("200"), count("400")
    messages = [{"role": "user", "content": "hi"}]
    scripted_http.post("/v1/chat/completions", json={"model": SCRIPTED_MODEL, "messages": messages})
    scripted_http.post("/v1/chat/completions", json={"model": SCRIPTED_MODEL, "messages": []})
    assert count("200") == ok + 1
    assert count("400") == bad + 1


def test_openapi_documents_the_wire_types(scripted_http: httpx.Client) -> None:
    doc = scripted_http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    assert set(schemas["ChatCompletionRequest"]["properties"]) == set(
        ChatCompletionRequest.__struct_fields__
    )
    assert set(schemas["CompletionRequest"]["properties"]) == set(
        CompletionRequest.__struct_fields__
    )
    assert (
        schemas["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"][0]["maximum"] == 2.0
    )
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    for path in ("/v1/completions", "/v1/models", "/health", "/ready", "/metrics", "/version"):
        assert path in doc["paths"]

    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            found = [node["$ref"]] if "$ref" in node else []
            return found + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for target in refs(doc):
        assert target.split("/")[-1] in schemas, target
