"""Deployment files, validated offline: Kubernetes manifests against the API schemas (and KEDA's CRD), the
values they carry against the worker's own settings loader, and the promises between files (ports, probes,
grace period, replicas vs partitions)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tools import REPO
from worker.settings import load_settings

K8S = REPO / "deploy" / "k8s"
# The overlay for exactly-once: the base with a StatefulSet in place of the Deployment.
K8S_EXACTLY_ONCE = REPO / "deploy" / "k8s-exactly-once"
KEDA_CRDS = K8S / "keda-crds"
# The oldest Kubernetes minor still supported upstream when this was written; the manifests use nothing newer.
KUBERNETES_VERSION = "1.33.0"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) for doc in _documents(path)]


def _statefulset() -> dict[str, Any]:
    return _documents(K8S_EXACTLY_ONCE / "statefulset.yaml")[0]


def _by_kind(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [doc for _, doc in _manifests() if doc["kind"] == kind]
    if name is not None:
        found = [doc for doc in found if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields forbidden: the API server would silently prune a misspelt field,
    so a typo in a manifest would otherwise pass here and be ignored in the cluster."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


def _crd_validator(kind: str) -> jsonschema.protocols.Validator:
    for path in KEDA_CRDS.glob("*.yaml"):
        crd = _documents(path)[0]
        if crd["spec"]["names"]["kind"] == kind:
            version = next(v for v in crd["spec"]["versions"] if v["served"] and v["storage"])
            schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            return jsonschema.Draft7Validator(schema)
    raise AssertionError(f"no CRD for {kind} in {KEDA_CRDS}")


KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}


@pytest.mark.parametrize(
    ("file", "doc"),
    [pytest.param(file, doc, id=f"{file}:{doc['kind']}") for file, doc in _manifests()],
)
def test_every_manifest_is_valid_for_its_api(file: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "Kustomization":
        missing = [name for name in doc["resources"] if not (K8S / name).is_file()]
        assert missing == []
        return
    if doc["kind"] in KEDA_KINDS:
        errors = sorted(_crd_validator(doc["kind"]).iter_errors(doc), key=str)
        assert errors == [], [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_exactly_once_statefulset_is_valid_and_runs_the_deployments_pod() -> None:
    """The overlay's StatefulSet differs from the Deployment only in what keeps pod names stable: a pod
    template that drifted from deployment.yaml would ship probes, limits or security settings of its own."""
    statefulset = _statefulset()
    kubernetes_validate.validate(statefulset, KUBERNETES_VERSION, strict=True)
    deployment = _by_kind("Deployment")
    assert statefulset["spec"]["template"] == deployment["spec"]["template"]
    assert statefulset["spec"]["selector"] == deployment["spec"]["selector"]
    assert statefulset["spec"]["serviceName"] == _by_kind("Service")["metadata"]["name"]
    assert "replicas" not in statefulset["spec"]  # KEDA's, as for the Deployment
    # The default transactional id is "<group_id>-<host name>": the pod's stable name. An explicit id in
    # the ConfigMap would be shared by every pod, which then fence each other.
    assert "TRIAGE_PIPELINE__TRANSACTIONAL_ID" not in _by_kind("ConfigMap")["data"]


def test_the_validator_catches_a_misspelt_field() -> None:
    """Guards the two checks above: a typo must fail, not be pruned."""
    scaled = copy.deepcopy(_by_kind("ScaledObject"))
    scaled["spec"]["maxReplicas"] = scaled["spec"].pop("maxReplicaCount")
    assert any("maxReplicas" in e.message for e in _crd_validator("ScaledObject").iter_errors(scaled))
    deployment = copy.deepcopy(_by_kind("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_configmap_is_settings_the_worker_accepts() -> None:
    data = _by_kind("ConfigMap")["data"]
    assert all(key.startswith(("TRIAGE_", "KAFKA_")) for key in data)
    settings = load_settings(env=data)  # raises with the key's name on any bad value
    assert settings.metrics.port is not None
    assert settings.kafka["bootstrap.servers"] == data["KAFKA_BOOTSTRAP_SERVERS"]


def test_the_files_agree_with_each_other() -> None:
    settings = load_settings(env=_by_kind("ConfigMap")["data"])
    deployment = _by_kind("Deployment")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    port = next(p for p in container["ports"] if p["name"] == "metrics")
    assert port["containerPort"] == settings.metrics.port
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(settings.metrics.port)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["args"] == ["run"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    # SIGTERM → finish in-flight work for shutdown_timeout_ms, then flush and commit: the kubelet must wait.
    assert pod["spec"]["terminationGracePeriodSeconds"] * 1000 > settings.pipeline.shutdown_timeout_ms + 5000
    # A rebalance holds the loop for up to revoke_timeout_ms: liveness must not call that a stall.
    assert settings.metrics.stall_timeout_ms > settings.pipeline.revoke_timeout_ms
    assert "replicas" not in deployment["spec"]  # KEDA owns the replica count
    labels = pod["metadata"]["labels"]
    for selector in (
        deployment["spec"]["selector"]["matchLabels"],
        _by_kind("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        _by_kind("Service")["spec"]["selector"],
    ):
        assert selector.items() <= labels.items()
    service_port = _by_kind("Service")["spec"]["ports"][0]
    assert service_port["targetPort"] == "metrics" and service_port["port"] == settings.metrics.port

    scaled = _by_kind("ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # More consumers than partitions would sit idle.
    assert scaled["maxReplicaCount"] == settings.topics.partitions
    trigger = scaled["triggers"][0]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["consumerGroup"] == settings.pipeline.group_id
    assert trigger["metadata"]["topic"] == settings.topics.input
    assert trigger["metadata"]["bootstrapServers"] == settings.kafka["bootstrap.servers"]


def test_the_sasl_example_feeds_both_the_worker_and_keda() -> None:
    secret = _by_kind("Secret")
    auth = _by_kind("TriggerAuthentication")
    keys = {ref["key"] for ref in auth["spec"]["secretTargetRef"]}
    assert keys <= secret["stringData"].keys()
    assert all(ref["name"] == secret["metadata"]["name"] for ref in auth["spec"]["secretTargetRef"])
    worker_env = {k: v for k, v in secret["stringData"].items() if k.startswith("KAFKA_")}
    settings = load_settings(env={**_by_kind("ConfigMap")["data"], **worker_env})
    assert settings.kafka["sasl.password"] == "change-me"
    assert settings.kafka["security.protocol"] == "SASL_SSL"
    # The Deployment takes it as optional, so clusters without SASL need no Secret.
    env_from = _by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]["envFrom"]
    assert {"secretRef": {"name": secret["metadata"]["name"], "optional": True}} in env_from


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (kustomize build)")
def test_kustomize_builds_the_manifests() -> None:
    built = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(built.stdout) if doc)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Job",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ScaledObject",
        "Service",
    ]
    exactly_once = subprocess.run(
        ["kubectl", "kustomize", str(K8S_EXACTLY_ONCE)], capture_output=True, text=True, check=False
    )
    assert exactly_once.returncode == 0, exactly_once.stderr
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(exactly_once.stdout) if doc}
    assert sorted(docs) == sorted({*kinds, "StatefulSet"} - {"Deployment"})
    assert load_settings(env=docs["ConfigMap"]["data"]).pipeline.guarantee == "exactly_once"
    target = docs["ScaledObject"]["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "triage-worker"}
    kubernetes_validate.validate(docs["StatefulSet"], KUBERNETES_VERSION, strict=True)
    monitoring = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "monitoring")], capture_output=True, text=True, check=False
    )
    assert monitoring.returncode == 0, monitoring.stderr
    assert [doc["kind"] for doc in yaml.safe_load_all(monitoring.stdout) if doc] == ["PodMonitor"]


def _pod_specs() -> dict[str, dict[str, Any]]:
    return {kind: _by_kind(kind)["spec"]["template"] for kind in ("Deployment", "Job")}


def test_pods_get_no_kubernetes_service_link_variables() -> None:
    """A Service named `kafka` would otherwise put KAFKA_PORT=tcp://... into the worker's environment."""
    for kind, template in _pod_specs().items():
        assert template["spec"]["enableServiceLinks"] is False, kind


def test_every_pod_turns_the_model_libraries_telemetry_off() -> None:
    """docs/privacy.md: no connection but the broker's, the registry's and the metrics port, whatever image
    runs; the variable is set on the container itself, where no ConfigMap can take it away."""
    templates = {**_pod_specs(), "StatefulSet": _statefulset()["spec"]["template"]}
    for kind, template in templates.items():
        for container in template["spec"]["containers"]:
            assert {"name": "ORT_DISABLE_TELEMETRY", "value": "1"} in container.get("env", []), kind


def test_a_not_ready_pod_never_blocks_a_node_drain() -> None:
    assert _by_kind("PodDisruptionBudget")["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def _port_allowed(rule: dict[str, Any], port: int | str, protocol: str = "TCP") -> bool:
    return any(
        allowed.get("protocol", "TCP") == protocol
        and (allowed["port"] == port or allowed["port"] <= port <= allowed.get("endPort", allowed["port"]))
        for allowed in rule.get("ports", [])
        if isinstance(allowed["port"], int) == isinstance(port, int)
    )


def test_the_network_policy_admits_only_prometheus_and_lets_out_only_dns_kafka_and_the_registry() -> None:
    policy = _by_kind("NetworkPolicy")["spec"]
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    for kind, template in _pod_specs().items():
        assert policy["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), kind
    # In: one rule, the container's metrics port by name (which also serves POST /reload, closed without a
    # token file), from Prometheus pods only.
    (ingress,) = policy["ingress"]
    container_ports = _by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["port"] for p in ingress["ports"]] == [p["name"] for p in container_ports] == ["metrics"]
    assert all(source.get("podSelector", {}).get("matchLabels") for source in ingress["from"])
    # Out: DNS to the cluster's resolver, the broker port the ConfigMap names, the Schema Registry's port
    # (a worker reading Avro was cut off from its registry before); nothing else.
    dns, kafka, registry = policy["egress"]
    assert _port_allowed(dns, 53, "UDP") and _port_allowed(dns, 53, "TCP")
    assert dns["to"][0]["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    bootstrap = load_settings(env=_by_kind("ConfigMap")["data"]).kafka["bootstrap.servers"]
    assert all(_port_allowed(kafka, int(server.rsplit(":", 1)[1])) for server in bootstrap.split(","))
    assert not _port_allowed(kafka, 443) and not _port_allowed(kafka, 9400)
    assert _port_allowed(registry, 8081) and not _port_allowed(registry, 443)


# PodMonitor fields this project uses, as the Prometheus Operator's CRD (monitoring.coreos.com/v1) defines
# them; its schema is not vendored here, so a misspelt field must at least not be one of these.
_PODMONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
_PODMONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme"}


def test_the_pod_monitor_scrapes_the_worker_pods_metrics_port() -> None:
    (monitor,) = _documents(K8S / "monitoring" / "podmonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    spec = monitor["spec"]
    assert spec.keys() <= _PODMONITOR_SPEC
    pod = _by_kind("Deployment")["spec"]["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint.keys() <= _PODMONITOR_ENDPOINT
    assert (
        endpoint["port"] == "metrics"
        and endpoint["path"] == pod["metadata"]["annotations"]["prometheus.io/path"]
    )
    assert int(endpoint["scrapeTimeout"].rstrip("s")) < int(endpoint["interval"].rstrip("s"))
