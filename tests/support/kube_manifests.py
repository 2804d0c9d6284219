"""The rendered Kubernetes manifests, read as the deploy tests read them (a helper, not a
test): `kubectl kustomize` of an overlay (with components: "overlays/gpu+tls"), its objects,
workloads (a LeaderWorkerSet as its leader and worker templates), ConfigMaps, and what one
container gets: its variables, the Secret behind a mounted file, the service it runs."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagemesh.tools.mesh_secrets import INTERNAL_TOKEN, REDIS_PASSWORD
from tests.support.paths import REPO_ROOT

KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
SCHEMAS_DIR = KUBERNETES_DIR / "schemas"
# The oldest Kubernetes the manifests promise (deploy/kubernetes/README.md, docs/kubernetes.md).
KUBERNETES_VERSION = "1.30.0"
# "+component": the overlay with a component of deploy/kubernetes/components added, as a user
# adds it (`components:` in the overlay).
OVERLAYS = (
    "overlays/cpu",
    "overlays/gpu",
    "overlays/gpu+tls",
    "overlays/lws",
    "overlays/disaggregated",
)
GROUP_FOLDER_OVERLAYS = (
    "overlays/cpu",
    "overlays/gpu",  # engine groups from groups/<name>
    "overlays/disaggregated",
)
GPU_OVERLAYS = ("overlays/gpu", "overlays/gpu+tls", "overlays/lws")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    (
        "leaderworkerset.x-k8s.io/v1",
        "LeaderWorkerSet",
    ): "leaderworkerset-leaderworkerset.x-k8s.io-v1.json",
}
SERVICE_MODULES = {"router.main", "scheduler_svc.main", "worker_svc.main"}
PUBLIC_PORTS = {50051, 8000}
INTERNAL_PORTS = {
    "scheduler": {50060},
    "worker": {50070, 29500},
    "standby": {50070, 29500},
    "redis": {6379},
}
SHUTDOWN_GRACE_S = 5.0  # --shutdown-grace-s default
MESH_SECRET = "pagemesh-mesh"  # `kubectl create secret generic pagemesh-mesh --from-file=DIR`
# The flags every pagemesh container takes from that Secret, by file: flag variable -> key.
MESH_SECRET_FILES = {
    "PAGEMESH_REDIS_PASSWORD": REDIS_PASSWORD,
    "PAGEMESH_INTERNAL_TOKEN": INTERNAL_TOKEN,
}
DRAIN_TIMEOUT_S = 30.0  # --drain-timeout-s default


@functools.cache
def render(path: str) -> tuple[dict[str, Any], ...]:
    overlay, *components = path.split("+")
    with tempfile.TemporaryDirectory() as scratch:
        target = KUBERNETES_DIR / overlay
        if components:  # kustomize takes relative paths only
            kustomization = {
                "resources": [os.path.relpath(target, scratch)],
                "components": [
                    os.path.relpath(KUBERNETES_DIR / "components" / c, scratch) for c in components
                ],
            }
            target = Path(scratch)
            (target / "kustomization.yaml").write_text(json.dumps(kustomization))
        done = subprocess.run(
            ["kubectl", "kustomize", str(target)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [obj for obj in render(overlay) if obj["kind"] == kind]


def workloads(overlay: str) -> list[dict[str, Any]]:
    """Deployments and StatefulSets, and each LeaderWorkerSet as its leader and its workers
    (each a workload-like object with its own spec.template)."""
    found = [obj for obj in render(overlay) if obj["kind"] in ("Deployment", "StatefulSet")]
    for lws in objects(overlay, "LeaderWorkerSet"):
        for role in ("leader", "worker"):
            template = lws["spec"]["leaderWorkerTemplate"][f"{role}Template"]
            found.append(
                {
                    "kind": "LeaderWorkerSet",
                    "lws": lws,
                    "metadata": {"name": f"{lws['metadata']['name']} ({role})"},
                    "spec": {"template": template},
                }
            )
    return found


def config_maps(overlay: str) -> dict[str, dict[str, str]]:
    """Generated ConfigMaps by name, hash suffix and all."""
    return {cm["metadata"]["name"]: cm.get("data", {}) for cm in objects(overlay, "ConfigMap")}


def value_of(overlay: str, prefix: str, key: str) -> str:
    (data,) = [
        data for name, data in config_maps(overlay).items() if name.rsplit("-", 1)[0] == prefix
    ]
    return data[key]


def component(obj: dict[str, Any]) -> str:
    return obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def container_env(overlay: str, container: dict[str, Any]) -> dict[str, str | None]:
    """Every variable the container gets: env (None for valueFrom) and its envFrom maps."""
    env: dict[str, str | None] = {}
    maps = config_maps(overlay)
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value")
    # What its command exports before exec (the worker's ranks).
    env.update(
        {
            name: None
            for name in re.findall(r"\b(PAGEMESH_\w+)=", " ".join(container.get("command", [])))
        }
    )
    return env


def secret_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) behind the file `path` in `container`: the read-only secret volume
    mounted above it, and the key its `items` (or the key's own name) put at that path."""
    (mount,) = [
        m
        for m in container.get("volumeMounts", [])
        if path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mount.get("readOnly"), mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    relative = os.path.relpath(path, mount["mountPath"])
    items = volume["secret"].get("items")
    (key,) = [i["key"] for i in items if i["path"] == relative] if items else [relative]
    return volume["secret"]["secretName"], key


def service_module(container: dict[str, Any]) -> str | None:
    match = re.search(r"python -m (\S+)", " ".join(container.get("command", [])))
    return match.group(1) if match else None


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# The manifest tests render with `kubectl kustomize`: none runs without it.
needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not installed (renders with `kubectl kustomize`)",
)
