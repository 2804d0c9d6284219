"""deploy/kubernetes, the engine groups of every overlay: each a scheduler, tp x pp workers
and standbys (a prefill and a decode group in the disaggregated overlay), worker pods taking
every rank once from their ordinal (a LeaderWorkerSet's too), groups avoiding each other's
nodes, disruption budgets over the routers and all groups' workers. The schemas:
test_kubernetes_manifests.py."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from tests.support.kube_manifests import (
    GROUP_FOLDER_OVERLAYS,
    OVERLAYS,
    component,
    needs_kubectl,
    objects,
    selects,
    service_module,
    value_of,
    workloads,
)

pytestmark = needs_kubectl


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
