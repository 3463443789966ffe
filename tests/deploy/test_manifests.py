"""The Kubernetes example in ``deploy/``: every document passes the Kubernetes 1.37 schema
(strict: unknown fields are errors), and its parts fit together and fit the image."""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

from rankgate.app.cli import add_serve_arguments
from tests.deploy.dockerfile import parse

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.37.0"

Resource = dict[str, Any]


def documents() -> Iterator[tuple[Path, Resource]]:
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                yield path, document


def by_kind(kind: str) -> Resource:
    found = [doc for _, doc in documents() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/, got {len(found)}"
    return found[0]


def container(name: str) -> Resource:
    for item in by_kind("Deployment")["spec"]["template"]["spec"]["containers"]:
        if item["name"] == name:
            result: Resource = item
            return result
    raise AssertionError(f"no container {name!r} in the Deployment")


def env_of(item: Resource) -> dict[str, str]:
    return {entry["name"]: entry["value"] for entry in item.get("env", [])}


def flag(args: list[str], name: str) -> str:
    for arg in args:
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} is not set in {args}")


@pytest.mark.parametrize(
    ("path", "document"),
    [pytest.param(p, d, id=f"{p.name}:{d['kind']}") for p, d in documents()],
)
def test_schema(path: Path, document: Resource) -> None:
    kubernetes_validate.validate(document, K8S_VERSION, strict=True)


def test_schema_check_rejects_mistakes() -> None:
    deployment = by_kind("Deployment")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][1]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][1]["ports"][0]["containerPort"] = [80]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, K8S_VERSION, strict=True)


def test_the_service_reaches_the_gateway_port() -> None:
    deployment, service = by_kind("Deployment"), by_kind("Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    gateway = container("rankgate")
    ports = {port["name"]: port["containerPort"] for port in gateway["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports
    assert str(ports["http"]) == env_of(gateway)["RANKGATE_PORT"]
    exposed = {
        p["containerPort"]
        for c in deployment["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    assert exposed == set(ports.values()), "only the gateway's port is declared"


def test_gateway_probes_health_and_readiness() -> None:
    gateway = container("rankgate")
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    names = {port["name"] for port in gateway["ports"]}
    assert gateway["livenessProbe"]["httpGet"]["port"] in names
    assert gateway["readinessProbe"]["httpGet"]["port"] in names


def test_gateway_talks_to_vllm_in_the_pod() -> None:
    gateway, vllm = container("rankgate"), container("vllm")
    host, _, port = env_of(gateway)["RANKGATE_ENGINE"].rpartition(":")
    assert host == "127.0.0.1"
    assert port == flag(vllm["args"], "--grpc-port")
    kv = json.loads(flag(vllm["args"], "--kv-events-config"))
    assert kv["enable_kv_cache_events"] is True
    # vLLM's publisher binds only for a wildcard endpoint; a host name would make it connect.
    assert kv["endpoint"].startswith("tcp://*:")
    assert kv["replay_endpoint"].startswith("tcp://*:")
    assert env_of(gateway)["HF_HOME"] == env_of(vllm)["HF_HOME"], "one tokenizer source"


def test_gateway_env_names_real_flags() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flags = {s for action in parser._actions for s in action.option_strings}
    for name in env_of(container("rankgate")):
        if name.startswith("RANKGATE_"):
            option = "--" + name.removeprefix("RANKGATE_").lower().replace("_", "-")
            assert option in flags, f"{name} is not a `rankgate serve` option"


def test_gateway_runs_as_the_image_user() -> None:
    security = container("rankgate")["securityContext"]
    user, _, group = (
        parse(ROOT / "Dockerfile").stage("runtime").one("USER").arguments.partition(":")
    )
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == int(user)
    assert security["runAsGroup"] == int(group)
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False


def test_volumes_exist() -> None:
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for item in pod["containers"]:
        for mount in item.get("volumeMounts", []):
            assert mount["name"] in volumes
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in volumes.values()
        if "persistentVolumeClaim" in v
    }
    assert claims == {by_kind("PersistentVolumeClaim")["metadata"]["name"]}
