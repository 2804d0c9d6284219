"""deploy/kubernetes, the control plane's locks in every overlay: Valkey takes its ACL from the
Secret pagemesh-mesh (`pagemesh secrets DIR`) and never evicts, every pagemesh container reads
Redis' password and the internal token from that Secret as files (never a value in a
ConfigMap), and only the router binds 0.0.0.0: schedulers and workers bind their pod IP."""

from __future__ import annotations

import re
import urllib.parse

import pytest

from pagemesh.tools.embedded_valkey import USER as VALKEY_USER
from pagemesh.tools.mesh_secrets import VALKEY_ACL
from tests.support.kube_manifests import (
    MESH_SECRET,
    MESH_SECRET_FILES,
    OVERLAYS,
    component,
    config_maps,
    container_env,
    needs_kubectl,
    secret_file,
    service_module,
    value_of,
    workloads,
)

pytestmark = needs_kubectl


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_router_binds_every_interface_the_others_their_pod_ip(overlay: str) -> None:
    """The router binds 0.0.0.0 (clients, and port-forward and its probes at 127.0.0.1); a
    scheduler or worker binds the pod IP it advertises, so nothing in it may dial loopback."""
    assert not [name for name, data in config_maps(overlay).items() if "PAGEMESH_HOST" in data]
    for obj in workloads(overlay):
        name = obj["metadata"]["name"]
        for container in obj["spec"]["template"]["spec"]["containers"]:
            if service_module(container) is None:
                continue
            env = {e["name"]: e for e in container["env"]}
            assert (
                env["PAGEMESH_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
                == "status.podIP"
            )
            if component(obj) == "router":
                assert env["PAGEMESH_HOST"]["value"] == "0.0.0.0", name
                continue
            assert env["PAGEMESH_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", (
                name
            )
            hooks = [
                container[kind]["exec"]["command"]
                for kind in ("startupProbe", "readinessProbe", "livenessProbe")
            ]
            hooks.append(
                container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            )
            for command in hooks:
                assert not re.search(
                    r"\b(127\.0\.0\.1|localhost|0\.0\.0\.0)\b", " ".join(command)
                ), (name, command)


# Kubernetes' quantities and Valkey's memory units (Valkey: `mb` is 1024^2, `m` 10^6).
NUM_BYTES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "kb": 2**10, "mb": 2**20, "gb": 2**30}


def _num_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", text).groups()
    return int(number) * NUM_BYTES[unit]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_valkey_takes_its_acl_from_the_secret_and_never_evicts(overlay: str) -> None:
    (redis,) = [obj for obj in workloads(overlay) if component(obj) == "redis"]
    pod = redis["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][0] == "valkey-server"
    flags = dict(zip(container["args"][1::2], container["args"][2::2]))
    assert secret_file(pod, container, flags["--aclfile"]) == (MESH_SECRET, VALKEY_ACL)
    # Only the ACL (a hash) reaches Valkey, and no password on its command line.
    assert [v["secret"]["items"] for v in pod["volumes"]] == [
        [{"key": VALKEY_ACL, "path": VALKEY_ACL}]
    ]
    assert "--requirepass" not in flags
    # Full, it refuses writes (the services retry) before the kernel OOM-kills it.
    assert flags["--maxmemory-policy"] == "noeviction"
    assert _num_bytes(flags["--maxmemory"]) < _num_bytes(container["resources"]["limits"]["memory"])
    # The probes sign in as nobody: the ACL's default user may PING.
    for kind in ("readinessProbe", "livenessProbe"):
        assert container[kind]["exec"]["command"] == ["valkey-cli", "ping"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pagemesh_container_reads_the_redis_password_and_token_from_the_secret(
    overlay: str,
) -> None:
    for name, data in config_maps(overlay).items():
        assert not set(data) & {v + s for v in MESH_SECRET_FILES for s in ("", "_FILE")}, name
    url = urllib.parse.urlsplit(value_of(overlay, "pagemesh-common", "PAGEMESH_REDIS_URL"))
    assert (url.username, url.password) == (VALKEY_USER, None)
    seen = set()
    for obj in workloads(overlay):
        pod = obj["spec"]["template"]["spec"]
        for container in pod["containers"]:
            if service_module(container) is None:
                continue
            seen.add(component(obj))
            env = container_env(overlay, container)
            for variable, key in MESH_SECRET_FILES.items():
                assert variable not in env, obj["metadata"]["name"]  # never the value itself
                assert secret_file(pod, container, env[variable + "_FILE"]) == (MESH_SECRET, key)
    assert seen >= {"router", "scheduler", "worker"}
