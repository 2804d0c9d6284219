"""deploy/kubernetes/overlays/cpu, run without a cluster (issue 24): the rendered manifests'
pods as local processes, each container with its own command, args and environment, each pod
in a network namespace of its own (tests/support/kube_runner.py says what is translated). A
streamed request through the router Service's port has a worker pod's process SIGKILLed
mid-answer and still ends with the undisturbed run's tokens; then every pod is deleted
(preStop, SIGTERM, terminationGracePeriodSeconds) and nothing is left running. On the way,
Valkey and a worker refuse a client without the pagemesh-mesh Secret's password and token."""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from pagemesh.tools.embedded_valkey import USER as VALKEY_USER
from pagemesh.tools.mesh_process import greedy_request
from pagemesh.tools.mesh_secrets import REDIS_PASSWORD, write_secrets
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.pagemesh.v1 import generate_pb2_grpc
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.kube_pods import Manifests, data_of, render
from tests.support.kube_runner import KubeRun
from tests.support.paths import REPO_ROOT

OVERLAY = REPO_ROOT / "deploy" / "kubernetes" / "overlays" / "cpu"
REASON = (
    "no kubectl (it renders the overlay)"
    if shutil.which("kubectl") is None
    else f"no overlay at {OVERLAY}"
    if not (OVERLAY / "kustomization.yaml").exists()
    else None
)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"Kubernetes processes test: {REASON}")

# What docs/kubernetes.md has the operator create before applying: an empty keys file
# (open access).
API_KEYS_SECRET = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": "pagemesh-api-keys"},
    "data": {"api-keys": base64.b64encode(b"").decode()},
}
MESH_SECRET = "pagemesh-mesh"
ROUTER_SERVICE, REDIS_SERVICE, WORKER_SERVICE = (
    "pagemesh-router",
    "pagemesh-redis",
    "pagemesh-worker-g0",
)
WORKER = "pagemesh-worker-g0-0/worker"
PROMPT = [5, 9, 33, 2, 70, 11, 4]
NUM_TOKENS = 160


def _mesh_secret(folder: Path) -> dict:
    """The other Secret docs/kubernetes.md has the operator create: `pagemesh secrets DIR`,
    then `kubectl create secret generic pagemesh-mesh --from-file=DIR` (a key per file)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": MESH_SECRET},
        "data": {
            name: base64.b64encode(path.read_bytes()).decode()
            for name, path in write_secrets(folder).items()
        },
    }


def _stream(address: str, on_token: Callable[[int], None] | None = None) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        token_ids: list[int] = []
        for chunk in stub.Generate(greedy_request(PROMPT, NUM_TOKENS), timeout=60):
            token_ids += chunk.token_ids
            if on_token is not None:
                on_token(len(token_ids))
        return token_ids


def _redis(run: KubeRun, *, signed_in: bool = True) -> redis.Redis:
    """A client of the registry: as the services sign in (user and Secret's password), or
    as anyone."""
    host, port = run.address(REDIS_SERVICE, 6379).split(":")
    if not signed_in:
        return redis.Redis(host=host, port=int(port))
    password = data_of(run.manifests.by_kind["Secret"][MESH_SECRET])[REDIS_PASSWORD].strip()
    return redis.Redis(
        host=host, port=int(port), username=VALKEY_USER, password=password, decode_responses=True
    )


def _registry(run: KubeRun, kind: str) -> dict[str, dict]:
    """The registry's entries of one kind (worker, scheduler), by id."""
    cluster = run.running[WORKER].env["PAGEMESH_CLUSTER"]
    with _redis(run) as client:
        return {
            key.rsplit(":", 1)[1]: json.loads(client.get(key) or "{}")
            for key in client.scan_iter(f"{cluster}:{kind}:*")
        }


def _check_only_the_mesh_is_admitted(run: KubeRun) -> None:
    """Without the Secret's password Valkey answers PING (the probes) and nothing else;
    without its internal token a worker answers nothing."""
    with _redis(run, signed_in=False) as anonymous:
        assert anonymous.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            anonymous.keys("*")
    with grpc.insecure_channel(run.address(WORKER_SERVICE, 50070)) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).GetMemory(worker_pb2.GetMemoryRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value


def _check_network_policies(run: KubeRun) -> None:
    """Every connection into a pod that the run holds open (router -> scheduler -> workers,
    everyone -> Redis) is one the overlay's NetworkPolicies admit, were they enforced."""
    component = "app.kubernetes.io/component"
    seen = {
        (
            source.labels[component] if source else "outside",
            target.labels[component],
            port,
            run.manifests.ingress_allowed(source, target, port),
        )
        for source, target, port in run.connections()
    }
    assert ("router", "scheduler", 50060) in {s[:3] for s in seen}, seen
    assert {s[:2] for s in seen} & {("scheduler", "worker"), ("scheduler", "standby")}, seen
    assert all(allowed for *_, allowed in seen), sorted(seen)


def _short_pre_stop_sleeps(objects: list[dict]) -> list[dict]:
    """The objects with each preStop `sleep N` made `sleep 1`. The hooks still run, as the
    kubelet runs them; the workers' 35 s, which lets a scheduler on a draining node finish
    its drain with its whole group, would only add half a minute to the suite here."""
    for obj in objects:
        pod_spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod_spec.get("containers", []):
            command = (
                container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
            )
            if command and command[0] == "sleep":
                command[1:] = ["1"]
    return objects


def test_a_request_survives_a_killed_worker_pod(tmp_path: Path) -> None:
    started = time.monotonic()
    model = tmp_path / "tiny-llama"
    write_tiny_model(model, "llama", seed=1)
    manifests = Manifests(
        _short_pre_stop_sleeps(render(OVERLAY))
        + [API_KEYS_SECRET, _mesh_secret(tmp_path / "secrets")]
    )
    run = KubeRun(
        manifests,
        tmp_path / "run",
        model=model,
        # One core per worker's torch: the overlay's 0 means all of the node's,
        # and three workers share this machine's two.
        extra_env={"PAGEMESH_TORCH_THREADS": "1", "OTEL_TRACES_EXPORTER": "none"},
    )
    try:
        run.start()
        run.wait_ready(timeout_s=60)
        _check_only_the_mesh_is_admitted(run)
        router = run.address(ROUTER_SERVICE, 50051)
        expected = _stream(router)
        assert len(expected) == NUM_TOKENS

        killed_at: list[int] = []

        def kill_once(num_tokens: int) -> None:
            if not killed_at and num_tokens >= 4:
                run.kill(WORKER)
                killed_at.append(num_tokens)

        assert _stream(router, kill_once) == expected, f"{run.events}\n{run.log_tails()}"
        assert killed_at and killed_at[0] < NUM_TOKENS
        assert run.running[WORKER].restarts == 1, run.events  # restartPolicy Always
        if run.namespaces:
            _check_network_policies(run)

        # Who took rank 0 back: the standby (about a second) or the restarted pod (a reload).
        standby = next(r.pod.name for r in run.running.values() if "standby" in r.pod.name)
        scheduler = next(e for e in _registry(run, "scheduler").values() if e.get("group") == "g0")
        print(
            f"g0 after the kill: members {scheduler['members']}, "
            f"{scheduler['num_recoveries']} recovery; kubelet: {run.events}"
        )
        assert scheduler["num_recoveries"] == 1, scheduler
        assert scheduler["members"] in ([standby], ["pagemesh-worker-g0-0"]), scheduler
    finally:
        outcomes = run.stop()
        left = run.leftovers()
        run.close()
    assert left == [], left
    # Every container ended on SIGTERM within its pod's grace period, none SIGKILLed.
    assert not [label for label, o in outcomes.items() if o.killed], outcomes
    print(f"stopped: {outcomes}\ntotal {time.monotonic() - started:.1f} s")
