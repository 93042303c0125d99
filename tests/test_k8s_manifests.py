"""deploy/k8s: schema validation where a validator is installed, and the cross-references between manifests."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specdec_triton.metrics import _ACTIVE

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
MANIFESTS = ["deployment.yaml", "service.yaml", "hpa.yaml", "podmonitor.yaml"]
TRITON_QUEUE_METRIC = "nv_inference_pending_request_count"  # Triton's own gauge of requests not yet executing


def manifest(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def test_core_manifests_validate_against_the_kubernetes_schemas():
    validator = tool("kubernetes-validate")
    if validator is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    core = [str(K8S / name) for name in MANIFESTS if name != "podmonitor.yaml"]  # a CRD: no bundled schema
    result = subprocess.run([validator, "--strict", *core], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == len(core), result.stdout


def test_kustomization_builds_every_manifest():
    assert yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"] == MANIFESTS
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    built = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(built.stdout))
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PodMonitor", "Service"]


def test_probes_ports_and_gpu_of_the_deployment():
    deployment = manifest("deployment.yaml")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_service_hpa_and_podmonitor_point_at_the_deployment():
    deployment = manifest("deployment.yaml")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    port_names = {port["name"] for port in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    service = manifest("service.yaml")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {port["targetPort"] for port in service["spec"]["ports"]} == port_names
    podmonitor = manifest("podmonitor.yaml")
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [(e["port"], e["path"]) for e in podmonitor["spec"]["podMetricsEndpoints"]] == [("metrics", "/metrics")]
    hpa = manifest("hpa.yaml")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["metric"]["selector"]["matchLabels"] for m in hpa["spec"]["metrics"]}
    # the gauge the server exports (specdec_triton/metrics.py), on the model that holds the target's KV cache
    assert metrics == {_ACTIVE[0]: {"model": "target_verifier"}, TRITON_QUEUE_METRIC: {"model": "speculative_decoding"}}
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    assert {rule["name"]["matches"] for rule in adapter["rules"]["custom"]} == set(metrics)
