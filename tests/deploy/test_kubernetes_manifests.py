"""deploy/kubernetes: every overlay rendered by `kubectl kustomize`, every object validated
against the Kubernetes API schemas of KUBERNETES_VERSION (kubernetes-validate, strict: an
unknown field fails) or, for CRD kinds, the schema vendored in deploy/kubernetes/schemas/,
then the mesh's own invariants: only the router is exposed, NetworkPolicies keep scheduler
and worker ports internal, every container has resources, probes and a grace period, every
PAGEMESH_* variable is a flag its service takes, one GPU per worker, ranks cover tp x pp.
The secrets and bind addresses: test_kubernetes_secrets.py."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from pagemesh.runtime.config import _parse_bool
from pagemesh.runtime.ports import reserve_port
from tests.support.compose_files import command_parser, flag_variables
from tests.support.kube_manifests import (
    CRD_SCHEMAS,
    GPU_OVERLAYS,
    GROUP_FOLDER_OVERLAYS,
    INTERNAL_PORTS,
    KUBERNETES_VERSION,
    OVERLAYS,
    PUBLIC_PORTS,
    SCHEMAS_DIR,
    SERVICE_MODULES,
    SHUTDOWN_GRACE_S,
    component,
    container_env,
    needs_kubectl,
    objects,
    render,
    secret_file,
    selects,
    service_module,
    value_of,
    workloads,
)
from tests.support.paths import REPO_ROOT

pytestmark = needs_kubectl


# --- schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", [*OVERLAYS, "monitoring"])
def test_every_object_validates_against_the_api_schemas(overlay: str) -> None:
    import jsonschema
    import kubernetes_validate

    rendered = render(overlay)
    assert rendered
    for obj in rendered:
        crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd is not None:
            jsonschema.validate(obj, json.loads((SCHEMAS_DIR / crd).read_text()))
            for template in obj["spec"].get("leaderWorkerTemplate", {}).values():
                if isinstance(template, dict):  # a core PodTemplateSpec
                    kubernetes_validate.validate(
                        {
                            "apiVersion": "v1",
                            "kind": "PodTemplate",
                            "metadata": {"name": "t"},
                            "template": template,
                        },
                        KUBERNETES_VERSION,
                        strict=True,
                    )
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_validation_refuses_a_misspelt_field() -> None:
    import kubernetes_validate

    (router,) = [obj for obj in workloads("overlays/cpu") if component(obj) == "router"]
    broken = json.loads(json.dumps(router))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


# --- exposure and NetworkPolicies ---------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_router_is_exposed(overlay: str) -> None:
    exposed = [
        svc["metadata"]["name"]
        for svc in objects(overlay, "Service")
        if svc["spec"].get("type", "ClusterIP") in ("LoadBalancer", "NodePort")
    ]
    assert exposed in ([], ["pagemesh-router"])
    assert not objects(overlay, "Ingress")
    for obj in workloads(overlay):
        pod = obj["spec"]["template"]["spec"]
        assert not pod.get("hostNetwork"), obj["metadata"]["name"]
        for container in pod["containers"]:
            assert all("hostPort" not in p for p in container.get("ports", [])), obj["metadata"][
                "name"
            ]
    if overlay in GPU_OVERLAYS:
        assert exposed == ["pagemesh-router"]


def _allowed_from(overlay: str, labels: dict[str, str], port: int) -> list[dict[str, Any] | None]:
    """The `from` peers allowed to reach `port` of a pod with `labels` (None = anywhere)."""
    policies = [
        p for p in objects(overlay, "NetworkPolicy") if selects(p["spec"]["podSelector"], labels)
    ]
    assert any(
        "Ingress" in p["spec"]["policyTypes"] and not p["spec"].get("ingress") for p in policies
    ), f"no default-deny policy selects {labels}"
    peers: list[dict[str, Any] | None] = []
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            if ports and port not in ports:
                continue
            peers += rule.get("from") or [None]
    return peers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_keep_scheduler_worker_and_redis_ports_internal(overlay: str) -> None:
    for obj in workloads(overlay):
        labels = obj["spec"]["template"]["metadata"]["labels"]
        name = obj["metadata"]["name"]
        if component(obj) == "router":
            for port in PUBLIC_PORTS:
                assert None in _allowed_from(overlay, labels, port), f"{name}: {port} closed"
            continue
        for port in INTERNAL_PORTS[component(obj)]:
            peers = _allowed_from(overlay, labels, port)
            assert peers, f"{name}: nothing may reach {port}"
            # Who must reach it: routers dial schedulers, schedulers workers (and ranks each
            # other), every service Redis.
            caller = {"scheduler": "router", "redis": "worker"}.get(component(obj), "scheduler")
            for peer in peers:
                assert peer is not None and set(peer) == {"podSelector"}, (
                    f"{name}: {port} open to {peer}"
                )
                assert not selects(peer["podSelector"], {"app.kubernetes.io/name": "other"}), (
                    f"{name}: {port} open to pods outside pagemesh"
                )
            assert any(
                selects(
                    peer["podSelector"],
                    {
                        "app.kubernetes.io/part-of": "pagemesh",
                        "app.kubernetes.io/component": caller,
                    },
                )
                for peer in peers
            ), f"{name}: {caller} pods cannot reach {port}"


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


@functools.cache
def _flag_actions(module: str) -> dict[str, Any]:
    from pagemesh.runtime.config import env_name

    parser = command_parser(["python", "-m", module])
    return {
        env_name(a.option_strings[0]): a
        for a in parser._actions
        if a.option_strings and a.dest != "help"
    }


@functools.cache
def _flag_variables(module: str) -> set[str]:
    """Every variable the service reads: each flag's, and its `_FILE` form."""
    return flag_variables(command_parser(["python", "-m", module]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pagemesh_variable_is_a_flag_of_its_service(overlay: str) -> None:
    seen = set()
    for obj in workloads(overlay):
        for container in obj["spec"]["template"]["spec"]["containers"]:
            module = service_module(container)
            if module is None:
                continue
            seen.add(module)
            actions = _flag_actions(module)
            for name, value in container_env(overlay, container).items():
                if not name.startswith("PAGEMESH_"):
                    continue
                assert name in _flag_variables(module), (
                    f"{obj['metadata']['name']}: {module} takes no {name}"
                )
                if name not in actions:  # <FLAG>_FILE: the file holding the flag's value
                    assert value is None or value.startswith("/"), (name, value)
                    continue
                action = actions[name]
                if value is None:
                    continue
                if action.type is None:  # --flag/--no-flag
                    _parse_bool(value)
                else:
                    parsed = action.type(value)
                    assert action.choices is None or parsed in action.choices, (name, value)
    assert seen == SERVICE_MODULES


# --- engine groups ------------------------------------------------------------------------


def groups(overlay: str) -> dict[str, dict[str, dict[str, Any]]]:
    """group -> component -> workload."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for obj in workloads(overlay):
        group = obj["spec"]["template"]["metadata"]["labels"].get("pagemesh.io/group")
        if group is not None:
            found.setdefault(group, {})[component(obj)] = obj
    return found


@pytest.mark.parametrize("overlay", GROUP_FOLDER_OVERLAYS)
def test_each_group_is_a_scheduler_tp_x_pp_workers_and_standbys(overlay: str) -> None:
    tp = int(value_of(overlay, "pagemesh-layout", "PAGEMESH_TP"))
    pp = int(value_of(overlay, "pagemesh-layout", "PAGEMESH_PP"))
    found = groups(overlay)
    assert found
    for group, members in found.items():
        assert set(members) == {"scheduler", "worker", "standby"}, group
        assert members["scheduler"]["kind"] == "StatefulSet"
        assert members["scheduler"]["spec"]["replicas"] == 1
        workers = members["worker"]
        assert workers["kind"] == "StatefulSet"
        assert workers["metadata"]["name"] == f"pagemesh-worker-{group}"
        assert workers["spec"]["replicas"] == tp * pp, f"{group}: replicas must be tp x pp"
        assert workers["spec"]["podManagementPolicy"] == "Parallel"  # rank 0 waits for all
        assert workers["spec"]["updateStrategy"]["type"] == "OnDelete"
        for obj in members.values():
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector["pagemesh.io/group"] == group
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            (group_env,) = [e for e in container["env"] if e["name"] == "PAGEMESH_GROUP"]
            assert (
                group_env["valueFrom"]["fieldRef"]["fieldPath"]
                == "metadata.labels['pagemesh.io/group']"
            )
        (standby,) = members["standby"]["spec"]["template"]["spec"]["containers"]
        assert {"name": "PAGEMESH_STANDBY", "value": "true"} in standby["env"]


def test_the_disaggregated_overlay_has_a_prefill_and_a_decode_group() -> None:
    """Each group's scheduler names its role; every worker and standby serves KV transfers
    on the same fixed port, which the worker NetworkPolicy admits from other workers."""
    found = groups("overlays/disaggregated")
    roles = {}
    for group, members in found.items():
        (container,) = members["scheduler"]["spec"]["template"]["spec"]["containers"]
        roles[group] = {e["name"]: e.get("value") for e in container["env"]}["PAGEMESH_ROLE"]
        for kind in ("worker", "standby"):
            (worker,) = members[kind]["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in worker["env"]}
            assert env["PAGEMESH_KV_TRANSFER_PORT"] == "50090", (group, kind)
            assert {"name": "kv-transfer", "containerPort": 50090} in worker["ports"]
    assert roles == {"prefill0": "prefill", "decode0": "decode"}


def _ranks(
    container: dict[str, Any], pod_name: str, tp: int, pp: int, **env: str
) -> tuple[int, int]:
    """(tp_rank, pp_rank) the worker's own command derives in pod `pod_name`; (-1, -1) for
    a standby."""
    script = container["command"][2].replace(
        "exec python -m worker_svc.main",
        'if [ "$PAGEMESH_STANDBY" = true ]; then echo -1 -1; '
        'else echo "$PAGEMESH_TP_RANK $PAGEMESH_PP_RANK"; fi',
    )
    done = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={
            "PATH": os.environ["PATH"],
            "PAGEMESH_WORKER_ID": pod_name,
            "PAGEMESH_TP": str(tp),
            "PAGEMESH_PP": str(pp),
            **env,
        },
    )
    tp_rank, pp_rank = done.stdout.split()
    return int(tp_rank), int(pp_rank)


def test_worker_pods_take_every_rank_once_from_their_ordinal() -> None:
    (workers, *_) = [obj for obj in workloads("overlays/gpu") if component(obj) == "worker"]
    (container,) = workers["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["sh", "-c"]
    (worker_id,) = [e for e in container["env"] if e["name"] == "PAGEMESH_WORKER_ID"]
    assert worker_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    tp, pp = 2, 3
    ranks = [_ranks(container, f"pagemesh-worker-g12-{n}", tp, pp) for n in range(tp * pp)]
    assert ranks == [(n % tp, n // tp) for n in range(tp * pp)]  # worker_svc.main.parallel_config


def test_a_leader_worker_set_group_is_its_scheduler_then_every_rank_then_standbys() -> None:
    tp = int(value_of("overlays/lws", "pagemesh-layout", "PAGEMESH_TP"))
    pp = int(value_of("overlays/lws", "pagemesh-layout", "PAGEMESH_PP"))
    (lws,) = objects("overlays/lws", "LeaderWorkerSet")
    spec = lws["spec"]["leaderWorkerTemplate"]
    # Only the failed pod restarts: pagemesh re-forms a group itself (docs/fault-tolerance.md).
    assert spec.get("restartPolicy", "Default") in ("Default", "None")
    assert (
        lws["spec"]["startupPolicy"] == "LeaderCreated"
    )  # the leader is ready only after its workers
    num_standby = spec["size"] - 1 - tp * pp
    assert num_standby >= 0, "size must be 1 + tp x pp + standbys"
    (leader,) = spec["leaderTemplate"]["spec"]["containers"]
    (worker,) = spec["workerTemplate"]["spec"]["containers"]
    assert component({"spec": {"template": spec["leaderTemplate"]}}) == "scheduler"
    assert service_module(leader) == "scheduler_svc.main"
    for container in (leader, worker):
        (index,) = [e for e in container["env"] if e["name"] == "GROUP_INDEX"]
        assert (
            index["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"
        )
        assert 'export PAGEMESH_GROUP="g${GROUP_INDEX}"' in container["command"][2]
    # Worker pods are <lws>-<group>-<n>, n = 1 .. size-1.
    ranks = [_ranks(worker, f"pagemesh-group-3-{n}", tp, pp) for n in range(1, spec["size"])]
    assert ranks == [(n % tp, n // tp) for n in range(tp * pp)] + [(-1, -1)] * num_standby


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


@pytest.mark.parametrize("overlay", GROUP_FOLDER_OVERLAYS)
def test_replicas_of_different_groups_avoid_each_others_nodes(overlay: str) -> None:
    for group, members in groups(overlay).items():
        for name in ("worker", "standby"):
            template = members[name]["spec"]["template"]
            terms = template["spec"]["affinity"]["podAntiAffinity"][
                "preferredDuringSchedulingIgnoredDuringExecution"
            ]
            (term,) = [t["podAffinityTerm"] for t in terms]
            assert term["topologyKey"] == "kubernetes.io/hostname"
            other = dict(template["metadata"]["labels"], **{"pagemesh.io/group": "another"})
            assert selects(term["labelSelector"], other), f"{group}: does not avoid other groups"
            assert not selects(term["labelSelector"], template["metadata"]["labels"]), (
                f"{group}: avoids its own group"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_cover_routers_and_every_groups_workers(overlay: str) -> None:
    budgets = objects(overlay, "PodDisruptionBudget")
    for obj in workloads(overlay):
        if component(obj) in ("router", "worker"):
            labels = obj["spec"]["template"]["metadata"]["labels"]
            covering = [b for b in budgets if selects(b["spec"]["selector"], labels)]
            assert len(covering) == 1, obj["metadata"]["name"]
    (workers,) = [b for b in budgets if b["metadata"]["name"] == "pagemesh-worker"]
    assert workers["spec"]["maxUnavailable"] == 1  # one group down at a time, over all groups


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_reads_its_api_keys_from_a_secret_and_scales_on_a_pagemesh_metric(
    overlay: str,
) -> None:
    (router,) = [obj for obj in workloads(overlay) if component(obj) == "router"]
    pod = router["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    keys_file = container_env(overlay, container)["PAGEMESH_API_KEYS_FILE"]
    assert secret_file(pod, container, keys_file) == ("pagemesh-api-keys", "api-keys")
    (hpa,) = objects(overlay, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pagemesh-router"
    assert any(
        m["type"] == "Pods" and m["pods"]["metric"]["name"].startswith("pagemesh_")
        for m in hpa["spec"]["metrics"]
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pagemesh_pod_is_scraped(overlay: str) -> None:
    (metrics_service,) = [
        s for s in objects(overlay, "Service") if s["metadata"]["name"] == "pagemesh-metrics"
    ]
    for obj in workloads(overlay):
        if component(obj) == "redis":
            continue
        template = obj["spec"]["template"]
        (container,) = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
        assert container_env(overlay, container)["PAGEMESH_METRICS_PORT"] == str(ports["metrics"])
        assert selects(
            {"matchLabels": metrics_service["spec"]["selector"]}, template["metadata"]["labels"]
        )
    (monitor,) = render("monitoring")
    assert selects(monitor["spec"]["selector"], metrics_service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {
        p["name"] for p in metrics_service["spec"]["ports"]
    }


# --- probes -------------------------------------------------------------------------------


def _probe_commands(overlay: str) -> list[tuple[str, int, str, list[str]]]:
    """(workload, its gRPC port, probe kind, exec command) of every pagemesh container."""
    # The probes dial where the container binds (the test above): the router's 0.0.0.0 at
    # 127.0.0.1, a scheduler's or worker's pod IP as $PAGEMESH_HOST, expanded by `sh -c`.
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


# --- docs/kubernetes.md -------------------------------------------------------------------


def test_the_doc_names_files_and_objects_that_exist() -> None:
    doc = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    for path in set(re.findall(r"\b((?:deploy|compose|docs|tests)/[\w./-]*\w)", doc)):
        if path.startswith("deploy/pagemesh-"):  # kubectl's deploy/<name>
            continue
        assert (REPO_ROOT / path).exists(), path
    names = {obj["metadata"]["name"] for obj in render("overlays/gpu")}
    names |= {name.rsplit("-", 1)[0] for name in names}  # generated ConfigMaps' hash suffix
    for kind_name in set(re.findall(r"\b(?:deploy|sts|svc)/(pagemesh-[\w-]+)", doc)):
        assert kind_name in names or kind_name.endswith("-g2"), kind_name  # g2: the added group
    for variable in set(re.findall(r"\b(PAGEMESH_[A-Z_]+)", doc)):
        assert any(variable in _flag_variables(module) for module in SERVICE_MODULES), variable
