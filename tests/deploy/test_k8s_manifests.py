"""deploy/k8s/ without a cluster: every document parses, every field of a core kind exists in
the Kubernetes API (checked against kubernetes-asyncio's generated models, which follow the API's
OpenAPI definitions), the gateway's ConfigMap passes the gateway's own validation, its selectors
match the example engine pods, RBAC allows exactly the pod list/watch discovery needs, and the
engine commands use flags of the SGLang version their image names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client

from gateway.config import config_from_raw, read_toml
from tests.deploy.support import DEPLOY, check_engine_args, image_version
from tests.integration.fake_kube import selector_matches

K8S = DEPLOY / "k8s"

# kind -> the kubernetes-asyncio model of that kind
MODELS = {
    ("v1", "ServiceAccount"): client.V1ServiceAccount,
    ("v1", "ConfigMap"): client.V1ConfigMap,
    ("v1", "Service"): client.V1Service,
    ("apps/v1", "Deployment"): client.V1Deployment,
    ("rbac.authorization.k8s.io/v1", "Role"): client.V1Role,
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): client.V1RoleBinding,
}
PROMETHEUS_OPERATOR = {"ServiceMonitor", "PodMonitor"}


def documents() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in documents() if d["kind"] == kind]


def check_fields(value: Any, type_name: str, where: str) -> None:
    """Every key of `value` is a field of the API type `type_name` (recursively)."""
    if value is None:
        return
    m = re.fullmatch(r"list\[(.+)\]", type_name)
    if m:
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            check_fields(item, m[1], f"{where}[{i}]")
        return
    m = re.fullmatch(r"dict\((\w+), (.+)\)", type_name)
    if m:
        assert isinstance(value, dict), where
        for k, v in value.items():
            check_fields(v, m[2], f"{where}.{k}")
        return
    model = getattr(client, type_name, None)
    if model is None:  # str, int, bool, object (IntOrString, Quantity, ...)
        assert not isinstance(value, dict) or type_name == "object", f"{where}: {type_name} got a mapping"
        return
    assert isinstance(value, dict), f"{where}: {type_name} must be a mapping"
    fields = {json_name: model.openapi_types[attr] for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        assert key in fields, f"{where}: {type_name} has no field {key!r}"
        check_fields(item, fields[key], f"{where}.{key}")


def test_every_manifest_parses_and_uses_real_fields() -> None:
    docs = documents()
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ServiceMonitor"} <= kinds
    for path, doc in docs:
        if doc["kind"] in PROMETHEUS_OPERATOR:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        model = MODELS[(doc["apiVersion"], doc["kind"])]
        check_fields(doc, model.__name__, f"{path.name}:{doc['kind']}/{doc['metadata']['name']}")


def test_the_field_check_catches_a_typo() -> None:
    dep = by_kind("Deployment")[0]
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="no field 'readinesProbe'"):
        check_fields(bad, "V1Deployment", "typo")


def gateway_config() -> Any:
    (cm,) = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == "pd-gateway"]
    import tomllib

    return config_from_raw(tomllib.loads(cm["data"]["gateway.toml"]), "ConfigMap pd-gateway")


def test_gateway_config_is_valid_and_discovers_the_example_engines() -> None:
    cfg = gateway_config()
    assert cfg.kubernetes is not None and cfg.workers == ()
    k = cfg.kubernetes
    engines = [d for d in by_kind("Deployment") if d["metadata"]["name"].startswith("sglang-")]
    assert engines
    for dep in engines:
        pod = dep["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert dep["metadata"]["namespace"] == k.namespace
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        role = labels["pd-gateway/role"]
        selector = {"prefill": k.prefill_selector, "decode": k.decode_selector}[role]
        assert selector_matches(selector, labels), (selector, labels)
        other = {"prefill": k.decode_selector, "decode": k.prefill_selector}[role]
        assert not selector_matches(other, labels)
        (container,) = pod["spec"]["containers"]
        args = container["args"]
        check_engine_args("sglang", image_version(container["image"], "lmsysorg/sglang"), args)
        assert int(args[args.index("--port") + 1]) == k.port
        assert labels.get(k.engine_label) == "sglang"
        assert args[args.index("--disaggregation-mode") + 1] == role
        if role == "prefill":
            boot = pod["metadata"]["annotations"][k.bootstrap_port_annotation]
            assert boot == args[args.index("--disaggregation-bootstrap-port") + 1]


def test_rbac_allows_discovery_and_nothing_more() -> None:
    cfg = gateway_config()
    (role,) = by_kind("Role")
    (binding,) = by_kind("RoleBinding")
    (account,) = by_kind("ServiceAccount")
    assert role["metadata"]["namespace"] == cfg.kubernetes.namespace
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    gw = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "pd-gateway")
    assert gw["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_gateway_deployment_service_and_monitor_fit_together() -> None:
    gw = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "pd-gateway")
    spec = gw["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert container["args"][:3] == ["serve", "--config", "/etc/pd-gateway/gateway.toml"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    cfg = gateway_config()
    assert spec["terminationGracePeriodSeconds"] > cfg.shutdown_grace_s  # in-flight requests finish
    assert gw["spec"]["replicas"] >= 2
    env = {e["name"]: e for e in container["env"]}
    assert env[cfg.admin.token_env]["valueFrom"]["secretKeyRef"]["optional"] is True
    (svc,) = by_kind("Service")
    labels = gw["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    port = svc["spec"]["ports"][0]
    assert (
        port["targetPort"] == container["ports"][0]["name"] and container["ports"][0]["containerPort"] == 8000
    )
    (mon,) = by_kind("ServiceMonitor")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0] == {"port": port["name"], "path": "/metrics", "interval": "5s"}
    (pods,) = by_kind("PodMonitor")
    engine_labels = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "sglang-decode")
    assert (
        pods["spec"]["selector"]["matchLabels"].items()
        <= engine_labels["spec"]["template"]["metadata"]["labels"].items()
    )


def test_read_toml_is_what_the_image_reads(tmp_path: Path) -> None:
    """The ConfigMap's file, written where the pod mounts it, loads through `--config`."""
    (cm,) = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == "pd-gateway"]
    path = tmp_path / "gateway.toml"
    path.write_text(cm["data"]["gateway.toml"])
    assert config_from_raw(read_toml(path)) == gateway_config()
