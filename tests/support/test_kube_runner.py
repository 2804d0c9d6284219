"""The Kubernetes runner's reading of manifests: pods per workload, env as the kubelet
resolves it, `$(VAR)`, Service names to pod addresses, volumes to folders, the image's
entrypoint; on a small inline manifest shaped like deploy/kubernetes (no process starts)."""

from __future__ import annotations

import base64
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests.support.kube_pods import (
    KubeTranslationError,
    Manifests,
    container_argv,
    expand,
    image_config,
    render,
)
from tests.support.kube_runner import KubeRun
from tests.support.paths import REPO_ROOT

KEY = base64.b64encode(b"k1\n").decode()
MANIFEST = f"""
apiVersion: v1
kind: ConfigMap
metadata: {{name: pagemesh-config, namespace: pm}}
data:
  PAGEMESH_REDIS_URL: redis://valkey.pm.svc.cluster.local:6379/0
  PAGEMESH_CLUSTER: k8s
---
apiVersion: v1
kind: Secret
metadata: {{name: api-keys, namespace: pm}}
data: {{api_keys: {KEY}}}
---
apiVersion: v1
kind: Service
metadata: {{name: valkey, namespace: pm}}
spec:
  selector: {{app: valkey}}
  ports: [{{port: 6379, targetPort: redis}}]
---
apiVersion: v1
kind: Service
metadata: {{name: router, namespace: pm}}
spec:
  selector: {{app: router}}
  ports: [{{name: grpc, port: 50051}}, {{name: http, port: 80, targetPort: 8000}}]
---
apiVersion: v1
kind: Service
metadata: {{name: worker, namespace: pm}}
spec:
  clusterIP: None
  selector: {{app: worker}}
  ports: [{{port: 50070}}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: valkey, namespace: pm}}
spec:
  serviceName: valkey
  selector: {{matchLabels: {{app: valkey}}}}
  template:
    metadata: {{labels: {{app: valkey}}}}
    spec:
      containers:
      - name: valkey
        image: valkey/valkey:8.1-alpine
        args: ["--save", "", "--protected-mode", "no"]
        ports: [{{name: redis, containerPort: 6379}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: router, namespace: pm}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: router}}}}
  template:
    metadata: {{labels: {{app: router}}}}
    spec:
      volumes:
      - {{name: models, persistentVolumeClaim: {{claimName: models}}}}
      - {{name: keys, secret: {{secretName: api-keys}}}}
      containers:
      - name: router
        image: ghcr.io/example/pagemesh:cpu
        command: ["python", "-m", "router.main"]
        args: ["--api-keys-file", "/etc/pagemesh/api_keys", "--log-level", "$(LOG_LEVEL)"]
        envFrom: [{{configMapRef: {{name: pagemesh-config}}}}]
        env:
        - {{name: LOG_LEVEL, value: INFO}}
        - {{name: PAGEMESH_MODEL, value: /models/tiny}}
        - {{name: PAGEMESH_HOST, value: 0.0.0.0}}
        - {{name: POD_NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
        - {{name: PAGEMESH_ROUTER_ID, value: "$(POD_NAME)"}}
        volumeMounts:
        - {{name: models, mountPath: /models}}
        - {{name: keys, mountPath: /etc/pagemesh}}
        readinessProbe: {{grpc: {{port: 50051}}}}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: worker, namespace: pm}}
spec:
  replicas: 2
  serviceName: worker
  selector: {{matchLabels: {{app: worker}}}}
  template:
    metadata: {{labels: {{app: worker}}}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
      - name: worker
        image: pagemesh:cpu
        command: ["pagemesh", "worker"]
        env:
        - {{name: POD_IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
        - {{name: PAGEMESH_WORKER_ID, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
        - name: PAGEMESH_TP_RANK
          valueFrom: {{fieldRef: {{fieldPath: "metadata.labels['apps.kubernetes.io/pod-index']"}}}}
        - {{name: PAGEMESH_ADVERTISE_HOST, value: "$(PAGEMESH_WORKER_ID).worker"}}
        - {{name: PAGEMESH_DEVICE, value: "cuda:0"}}
        - name: PAGEMESH_REDIS_URL
          valueFrom: {{configMapKeyRef: {{name: pagemesh-config, key: PAGEMESH_REDIS_URL}}}}
        - {{name: ESCAPED, value: "$$(POD_IP)"}}
        - {{name: CPUS, valueFrom: {{resourceFieldRef: {{resource: limits.cpu}}}}}}
        resources: {{limits: {{cpu: 1500m}}}}
"""


@pytest.fixture
def run(tmp_path: Path) -> KubeRun:
    manifests = Manifests(list(yaml.safe_load_all(MANIFEST)))
    return KubeRun(
        manifests,
        tmp_path,
        model=tmp_path / "tiny",
        use_namespaces=False,
        volume_dirs={"models": tmp_path / "models"},
    ).prepare()


def _router(run: KubeRun) -> str:
    return next(label for label in run.running if label.startswith("router-"))


def test_workloads_expand_into_pods(run: KubeRun) -> None:
    router, *others = [p.name for p in run.pods]
    assert re.fullmatch(r"router-[a-z0-9]{10}-[a-z0-9]{5}", router), router
    assert others == ["valkey-0", "worker-0", "worker-1"]
    worker = run.manifests.pod("worker-1")
    assert worker.labels["apps.kubernetes.io/pod-index"] == "1"
    assert (worker.hostname, worker.subdomain, worker.grace_s) == ("worker-1", "worker", 5.0)
    assert len({p.ip for p in run.pods}) == 4


def test_env_as_the_kubelet_resolves_it(run: KubeRun) -> None:
    router = run.running[_router(run)]
    assert router.container.env["PAGEMESH_ROUTER_ID"] == router.pod.name
    assert router.container.env["PAGEMESH_CLUSTER"] == "k8s"  # envFrom
    worker = run.running["worker-1/worker"].container.env
    assert worker["PAGEMESH_TP_RANK"] == "1" and worker["PAGEMESH_WORKER_ID"] == "worker-1"
    assert worker["ESCAPED"] == "$(POD_IP)" and worker["CPUS"] == "2"
    assert worker["POD_IP"] == run.manifests.pod("worker-1").ip


def test_names_and_paths_are_local(run: KubeRun, tmp_path: Path) -> None:
    valkey, worker1 = run.manifests.pod("valkey-0").ip, run.manifests.pod("worker-1").ip
    router = run.running[_router(run)]
    assert router.env["PAGEMESH_REDIS_URL"] == f"redis://{valkey}:6379/0"
    assert router.env["PAGEMESH_HOST"] == router.pod.ip  # the loopback: the pod's own address
    assert router.env["PAGEMESH_MODEL"] == str(tmp_path / "tiny")
    keys = Path(router.argv[router.argv.index("--api-keys-file") + 1])
    assert keys.read_text() == "k1\n" and router.argv[-1] == "INFO"
    worker = run.running["worker-1/worker"]
    assert worker.env["PAGEMESH_ADVERTISE_HOST"] == worker1  # headless per-pod name
    assert worker.env["PAGEMESH_DEVICE"] == "cpu"
    assert worker.argv == ["pagemesh", "worker"] and worker.cwd == REPO_ROOT
    assert run.address("router", 80) == f"{router.pod.ip}:8000"


def test_images_entrypoints() -> None:
    pagemesh = image_config("pagemesh:cpu")
    assert pagemesh.cmd[:2] == ["pagemesh", "up"] and pagemesh.workdir == "/opt/pagemesh"
    assert "cuda" in image_config("registry.local:5000/pagemesh:cuda").cmd
    valkey = image_config("valkey/valkey:8.1-alpine")
    assert container_argv({"args": ["--port", "1"]}, valkey) == ["valkey-server", "--port", "1"]
    assert container_argv({"command": ["sh"]}, pagemesh) == ["sh"]
    assert container_argv({"args": ["pagemesh", "router"]}, pagemesh) == ["pagemesh", "router"]
    with pytest.raises(KubeTranslationError):
        image_config("busybox")


def test_expand_leaves_unknown_names() -> None:
    assert expand("$(A)-$(B)-$$(A)", {"A": "1"}) == "1-$(B)-$(A)"


def test_an_unknown_service_name_is_an_error(tmp_path: Path) -> None:
    objects = list(yaml.safe_load_all(MANIFEST.replace("valkey.pm.svc", "valkee.pm.svc")))
    with pytest.raises(KubeTranslationError, match="valkee"):
        KubeRun(Manifests(objects), tmp_path, use_namespaces=False).prepare()


def test_a_missing_config_key_is_an_error(tmp_path: Path) -> None:
    typo = MANIFEST.replace("key: PAGEMESH_REDIS_URL", "key: REDIS_URL")
    objects = list(yaml.safe_load_all(typo))
    with pytest.raises(KubeTranslationError, match="REDIS_URL"):
        KubeRun(Manifests(objects), tmp_path, use_namespaces=False).prepare()


KUBELET = """
apiVersion: v1
kind: Pod
metadata: {name: stubborn}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: pagemesh:cpu
    command: ["python", "-c", "import signal, time;
      signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: polite}
spec:
  replicas: 1
  template:
    spec:
      terminationGracePeriodSeconds: 20
      containers:
      - name: main
        image: pagemesh:cpu
        command: ["python", "-c", "import time; time.sleep(60)"]
        lifecycle: {preStop: {exec: {command: ["touch", "/work/stopped"]}}}
        volumeMounts: [{name: work, mountPath: /work}]
        readinessProbe: {exec: {command: ["test", "-d", "/work"]}}
      volumes: [{name: work, emptyDir: {}}]
"""


def test_the_kubelet_restarts_and_stops(tmp_path: Path) -> None:
    """A killed container comes back (restartPolicy Always); deletion runs preStop, then
    SIGTERM, and SIGKILLs only what outlives its grace period; nothing is left."""
    run = KubeRun(Manifests(list(yaml.safe_load_all(KUBELET))), tmp_path, use_namespaces=False)
    try:
        run.start()
        run.wait_ready(timeout_s=30)
        polite = next(label for label in run.running if label.startswith("polite-"))
        run.kill("stubborn/main")
        deadline = time.monotonic() + 10
        while run.running["stubborn/main"].restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run.running["stubborn/main"].restarts == 1, run.events
        outcomes = run.stop()
    finally:
        run.close()
    assert outcomes["stubborn/main"].killed and 1.0 <= outcomes["stubborn/main"].seconds < 3
    assert not outcomes[polite].killed and outcomes[polite].seconds < 5
    assert (tmp_path / "volumes" / polite.split("/")[0] / "work" / "stopped").exists()
    assert run.leftovers() == []


def test_network_policies_admit_by_labels_and_ports(run: KubeRun) -> None:
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "valkey", "namespace": "pm"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "valkey"}},
            "ingress": [
                {
                    "from": [
                        {
                            "podSelector": {
                                "matchExpressions": [
                                    {"key": "app", "operator": "In", "values": ["router"]}
                                ]
                            }
                        }
                    ],
                    "ports": [{"port": "redis"}],
                }
            ],
        },
    }
    manifests = Manifests(run.manifests.objects + [policy])
    valkey, worker = manifests.pod("valkey-0"), manifests.pod("worker-0")
    router = next(p for p in manifests.pods if p.name.startswith("router-"))
    assert manifests.ingress_allowed(router, valkey, 6379)
    assert not manifests.ingress_allowed(worker, valkey, 6379)
    assert not manifests.ingress_allowed(router, valkey, 6380)
    assert not manifests.ingress_allowed(None, valkey, 6379)
    assert manifests.ingress_allowed(None, worker, 50070)  # no policy selects the workers


OVERLAYS = REPO_ROOT / "deploy" / "kubernetes" / "overlays"


@pytest.mark.skipif(
    shutil.which("kubectl") is None or not OVERLAYS.exists(),
    reason="needs kubectl and deploy/kubernetes/overlays",
)
@pytest.mark.parametrize("overlay", ["cpu", "gpu", "lws"])
def test_every_overlay_translates(overlay: str, tmp_path: Path) -> None:
    """Each overlay's pods resolve: every env source exists, every `*.svc` name is a Service,
    every mount a volume (the two Secrets are the operator's, as docs/kubernetes.md says)."""
    if not (OVERLAYS / overlay / "kustomization.yaml").exists():
        pytest.skip(f"no {overlay} overlay")
    keys = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "pagemesh-api-keys"},
        "data": {"api-keys": ""},
    }
    mesh = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "pagemesh-mesh"},
        "data": {"redis-password": "", "valkey.acl": "", "internal-token": ""},
    }
    run = KubeRun(
        Manifests(render(OVERLAYS / overlay) + [keys, mesh]),
        tmp_path,
        model=tmp_path / "model",
        use_namespaces=False,
    ).prepare()
    devices = {r.env.get("PAGEMESH_DEVICE") for r in run.running.values()} - {None}
    assert devices == {"cpu"}, devices
    assert any("router.main" in " ".join(r.argv) for r in run.running.values())
