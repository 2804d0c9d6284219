"""deploy/kubernetes, every container of every overlay: resources, probes and a grace period
that covers the SIGTERM drain, a worker's memory limit that holds its swap space and CPU KV
cache, a scheduler's startup probe that outwaits its workers, one GPU per worker and none
elsewhere; the probes themselves (each asks its container's own gRPC health: liveness any
answer, readiness SERVING) and the TLS component's certificate on the router. The schemas:
test_kubernetes_manifests.py."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from pagemesh.runtime.ports import reserve_port
from tests.support.kube_manifests import (
    GPU_OVERLAYS,
    OVERLAYS,
    SHUTDOWN_GRACE_S,
    component,
    container_env,
    needs_kubectl,
    service_module,
    value_of,
    workloads,
)

pytestmark = needs_kubectl


# --- containers ---------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_resources_probes_and_a_grace_period(overlay: str) -> None:
    for obj in workloads(overlay):
        pod = obj["spec"]["template"]["spec"]
        name = obj["metadata"]["name"]
        assert "terminationGracePeriodSeconds" in pod, name
        for container in pod["containers"]:
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), name
            assert "memory" in resources["limits"], name
            assert "readinessProbe" in container and "livenessProbe" in container, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_cover_the_sigterm_drain(overlay: str) -> None:
    drain_s = float(value_of(overlay, "pagemesh-scheduler", "PAGEMESH_DRAIN_TIMEOUT_S"))
    for obj in workloads(overlay):
        pod = obj["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        grace_s = pod["terminationGracePeriodSeconds"]
        pre_stop = (
            container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        )
        pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        needed = pre_stop_s + SHUTDOWN_GRACE_S
        if component(obj) == "scheduler":
            needed += drain_s
        if component(obj) in ("worker", "standby"):
            # Alive until its scheduler, evicted alongside, has drained.
            assert pre_stop_s >= drain_s, obj["metadata"]["name"]
        assert grace_s >= needed, f"{obj['metadata']['name']}: {grace_s} s < {needed} s"


GIB = {"Gi": 1.0, "Mi": 1 / 1024}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_workers_host_memory_holds_its_swap_space_and_cpu_kv_cache(overlay: str) -> None:
    """Past its memory limit a worker is OOM-killed: the limit must hold --swap-space and,
    on CPU, the KV cache, which must be sized explicitly (the default fraction is of the
    node's memory, not the pod's)."""
    for obj in workloads(overlay):
        if component(obj) not in ("worker", "standby"):
            continue
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        env = container_env(overlay, container)
        limit = container["resources"]["limits"]["memory"]
        limit_gib = float(limit[:-2]) * GIB[limit[-2:]]
        needed_gib = float(env.get("PAGEMESH_SWAP_SPACE") or 4.0)
        if env["PAGEMESH_DEVICE"] == "cpu":
            needed_gib += float(env["PAGEMESH_KV_CACHE_MEMORY_GIB"])
        assert needed_gib + 1 <= limit_gib, (
            f"{obj['metadata']['name']}: {needed_gib} GiB in {limit}"
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_scheduler_may_wait_for_its_workers_before_its_startup_probe_gives_up(
    overlay: str,
) -> None:
    """The scheduler serves gRPC only once its group has formed (scheduler_svc.main.serve:
    every worker registered within --worker-wait-s, and loaded)."""
    wait_s = float(value_of(overlay, "pagemesh-scheduler", "PAGEMESH_WORKER_WAIT_S"))
    for obj in workloads(overlay):
        if component(obj) == "scheduler":
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            probe = container["startupProbe"]
            assert probe["periodSeconds"] * probe["failureThreshold"] > wait_s, obj["metadata"][
                "name"
            ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_gpu_per_worker_and_none_elsewhere(overlay: str) -> None:
    for obj in workloads(overlay):
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        if overlay in GPU_OVERLAYS and component(obj) in ("worker", "standby"):
            assert gpus == "1", obj["metadata"]["name"]
            assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
        else:
            assert gpus is None, obj["metadata"]["name"]


# --- probes -------------------------------------------------------------------------------


def _probe_commands(overlay: str) -> list[tuple[str, int, str, list[str]]]:
    """(workload, its gRPC port, probe kind, exec command) of every pagemesh container."""
    # The probes dial where the container binds (test_kubernetes_secrets.py): the router's
    # 0.0.0.0 at 127.0.0.1, a scheduler's or worker's pod IP as $PAGEMESH_HOST, expanded by
    # `sh -c`.
    found = []
    for obj in workloads(overlay):
        for container in obj["spec"]["template"]["spec"]["containers"]:
            if service_module(container) is None:
                continue
            port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
            assert container_env(overlay, container)["PAGEMESH_PORT"] == str(port)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                found.append(
                    (obj["metadata"]["name"], port, kind, container[kind]["exec"]["command"])
                )
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_the_containers_own_grpc_health(overlay: str) -> None:
    for name, port, kind, command in _probe_commands(overlay):
        host = "127.0.0.1" if name.startswith("pagemesh-router") else "$PAGEMESH_HOST"
        assert f"pagemesh health --address {host}:{port} " in " ".join(command), (name, kind)
        if host.startswith("$"):
            assert command[:2] == ["sh", "-c"], (name, kind)


def _health_server(status: str) -> tuple[Any, int]:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", getattr(health_pb2.HealthCheckResponse, status))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_liveness_is_any_answer_and_readiness_is_serving() -> None:
    """The probe commands themselves, against a health server that says SERVING, one that
    says NOT_SERVING (a degraded scheduler, a loading worker: alive, not ready) and a port
    nobody listens on."""
    commands = {
        (name, kind): (port, command)
        for name, port, kind, command in _probe_commands("overlays/cpu")
    }
    port, liveness = commands[("pagemesh-scheduler-g0", "livenessProbe")]
    _, readiness = commands[("pagemesh-scheduler-g0", "readinessProbe")]
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/"),
        "PAGEMESH_HOST": "127.0.0.1",
    }  # the pod IP, which the scheduler binds

    def passes(command: list[str], target_port: int) -> bool:
        argv = [word.replace(f":{port} ", f":{target_port} ") for word in command]
        assert argv != command, command
        return (
            subprocess.run(argv, env=env, capture_output=True, timeout=30, check=False).returncode
            == 0
        )

    serving, serving_port = _health_server("SERVING")
    not_serving, not_serving_port = _health_server("NOT_SERVING")
    try:
        with futures.ThreadPoolExecutor(max_workers=6) as pool:
            cases = {
                (probe, target): pool.submit(passes, command, target_port)
                for probe, command in (("liveness", liveness), ("readiness", readiness))
                for target, target_port in (
                    ("serving", serving_port),
                    ("not_serving", not_serving_port),
                    ("nothing", reserve_port()),
                )
            }
            results = {case: future.result() for case, future in cases.items()}
    finally:
        serving.stop(0)
        not_serving.stop(0)
    assert results == {
        ("liveness", "serving"): True,
        ("liveness", "not_serving"): True,
        ("liveness", "nothing"): False,
        ("readiness", "serving"): True,
        ("readiness", "not_serving"): False,
        ("readiness", "nothing"): False,
    }


def test_the_tls_component_serves_the_routers_ports_with_the_secrets_certificate() -> None:
    (router,) = [obj for obj in workloads("overlays/gpu+tls") if component(obj) == "router"]
    pod = router["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = container_env("overlays/gpu+tls", container)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "pagemesh-tls"
    assert env["PAGEMESH_TLS_CERT"] == f"{mount['mountPath']}/tls.crt"
    assert env["PAGEMESH_TLS_KEY"] == f"{mount['mountPath']}/tls.key"
    assert "PAGEMESH_TLS_CA" not in env  # no client certificates asked of the public
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert f"--tls-ca {mount['mountPath']}/ca.crt" in " ".join(
            container[kind]["exec"]["command"]
        )
