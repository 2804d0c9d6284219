"""deploy/kubernetes, who reaches which pod in every overlay: only the router is exposed (it
reads its API keys from a Secret and scales on a pagemesh metric), NetworkPolicies keep
scheduler, worker and Redis ports to the pagemesh pods that dial them, and Prometheus scrapes
every pagemesh pod. The schemas: test_kubernetes_manifests.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.kube_manifests import (
    GPU_OVERLAYS,
    INTERNAL_PORTS,
    OVERLAYS,
    PUBLIC_PORTS,
    component,
    container_env,
    needs_kubectl,
    objects,
    render,
    secret_file,
    selects,
    workloads,
)

pytestmark = needs_kubectl


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
