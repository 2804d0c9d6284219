"""Rendered Kubernetes manifests -> the pods they make, each container as Kubernetes would run
it (a helper of kube_runner, pure: no processes, no network).

- Workloads expand into pods: a Deployment into `replicas` pods (`<name>-<hash>-<suffix>`,
  deterministic here, with `pod-template-hash`), a
  StatefulSet into `<name>-<i>` with hostname `<name>-<i>`, subdomain `serviceName` and the
  `apps.kubernetes.io/pod-index` and `statefulset.kubernetes.io/pod-name` labels, a
  LeaderWorkerSet into `replicas` groups of `size` pods (the leader `<name>-<g>`, workers
  `<name>-<g>-<i>`, with LWS's group-index / worker-index labels), a bare Pod into itself.
- A container's argv is its image's entrypoint and cmd as Kubernetes combines them with
  `command` and `args` (the pagemesh images' from the Dockerfile), its env is `envFrom` then
  `env` in order (`value`, `configMapKeyRef`, `secretKeyRef`, `fieldRef`, `resourceFieldRef`),
  and `$(VAR)` is expanded in env values (against the variables before it), command and args
  (against all of them) with `$$` as the escape, as the kubelet does.
- Service DNS: `<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc[.cluster.local]` name the first pod its
  selector matches (a ClusterIP has no single pod; with one replica it is the same), a
  headless Service's `<hostname>.<svc>...` the pod whose subdomain it is; a Service port
  maps to its targetPort (a number, or a container port's name).
"""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.paths import REPO_ROOT

CLUSTER_DOMAIN = "cluster.local"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet", "Pod")
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class KubeTranslationError(ValueError):
    """A manifest says something the local run cannot map (most likely a mistake in it)."""


def render(overlay: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize overlay`, parsed."""
    done = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True)
    if done.returncode != 0:
        raise KubeTranslationError(f"kubectl kustomize {overlay}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


# --- images


@dataclass(frozen=True)
class Image:
    entrypoint: list[str]
    cmd: list[str]
    workdir: str = "/"


def dockerfile_stages(path: Path = REPO_ROOT / "Dockerfile") -> dict[str, Image]:
    """Each stage's ENTRYPOINT, CMD and WORKDIR, inherited along `FROM <stage>` (exec form
    only; what the pagemesh Dockerfile uses)."""
    stages: dict[str, Image] = {}
    current = Image([], [])
    name = ""
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if not words or words[0].startswith("#"):
            continue
        op, rest = words[0].upper(), (words[1] if len(words) > 1 else "")
        if op == "FROM":
            parts = rest.split()
            base = stages.get(parts[0], Image([], []))
            name = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else ""
            current = base
        elif op in ("ENTRYPOINT", "CMD"):
            value = yaml.safe_load(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
            current = (
                Image(value, current.cmd if op == "CMD" else [], current.workdir)
                if op == "ENTRYPOINT"
                else Image(current.entrypoint, value, current.workdir)
            )
        elif op == "WORKDIR":
            current = Image(current.entrypoint, current.cmd, rest)
        if name:
            stages[name] = current
    return stages


# Third-party images the manifests may use: their entrypoint script runs the server when the
# first argument is a flag (docker-entrypoint.sh's rule).
THIRD_PARTY_IMAGES = {
    "valkey/valkey": Image(["docker-entrypoint.sh"], ["valkey-server"], "/data"),
    "redis": Image(["docker-entrypoint.sh"], ["redis-server"], "/data"),
}


def image_config(image: str) -> Image:
    repository, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
    if "pagemesh" in repository.split("/")[-1]:
        return dockerfile_stages()["cuda" if "cuda" in tag else "cpu"]
    for prefix, config in THIRD_PARTY_IMAGES.items():
        if repository == prefix or repository.endswith("/" + prefix):
            return config
    raise KubeTranslationError(f"image {image!r}: neither pagemesh nor a known third party")


def container_argv(container: dict[str, Any], image: Image) -> list[str]:
    """Kubernetes' rule: `command` replaces the entrypoint (and drops the cmd), `args` the cmd."""
    command = container.get("command")
    args = container.get("args")
    argv = (command if command is not None else image.entrypoint) + (
        args if args is not None else ([] if command is not None else image.cmd)
    )
    if argv[:1] == ["docker-entrypoint.sh"]:  # valkey/redis: a flag first means the server
        rest = argv[1:]
        argv = ([image.cmd[0]] + rest) if not rest or rest[0].startswith("-") else rest
    return [str(arg) for arg in argv]


# --- $(VAR) expansion and env


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)`: defined names expand, others stay as written, `$$` is `$`."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, str(text))


@dataclass
class Pod:
    """One pod of a workload. `ip` is given by whoever runs it, before `containers()`."""

    name: str
    namespace: str
    workload: str  # "StatefulSet/worker"
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    hostname: str
    subdomain: str | None
    claims: dict[str, str] = field(default_factory=dict)  # volumeClaimTemplate -> claim name
    ip: str = ""

    @property
    def restart_policy(self) -> str:
        return self.spec.get("restartPolicy", "Always")

    @property
    def grace_s(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", 30))

    def field(self, path: str) -> str:
        """A fieldRef's value."""
        labels = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if labels:
            source = self.labels if labels.group(1) == "labels" else self.annotations
            return source.get(labels.group(2), "")
        values = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": self.ip,
            "spec.nodeName": f"node-{self.name}",
            "metadata.uid": f"uid-{self.name}",
            "spec.serviceAccountName": self.spec.get("serviceAccountName", "default"),
        }
        if path not in values:
            raise KubeTranslationError(f"{self.name}: fieldRef {path!r}")
        return values[path]


@dataclass(frozen=True)
class Container:
    """A container as its runtime sees it: argv and env in container terms."""

    pod: str
    name: str
    argv: list[str]
    env: dict[str, str]
    working_dir: str
    mounts: dict[str, tuple[str, str]]  # mountPath -> (volume name, subPath)
    spec: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.pod}/{self.name}"


class Manifests:
    """The rendered objects of one overlay: its pods, their containers and its Services."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects
        self.by_kind: dict[str, dict[str, dict[str, Any]]] = {}
        for obj in objects:
            self.by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
        self.pods = [
            pod
            for kind in WORKLOAD_KINDS
            for obj in self.by_kind.get(kind, {}).values()
            for pod in _expand(obj)
        ]

    def pod(self, name: str) -> Pod:
        return next(pod for pod in self.pods if pod.name == name)

    # --- env

    def containers(self, pod: Pod, init: bool = False) -> list[Container]:
        key = "initContainers" if init else "containers"
        return [self._container(pod, spec) for spec in pod.spec.get(key) or []]

    def _container(self, pod: Pod, spec: dict[str, Any]) -> Container:
        env: dict[str, str] = {}
        for source in spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            for key, value in self._source_data(pod, source).items():
                env[prefix + key] = value
        for var in spec.get("env") or []:
            value = self._env_value(pod, spec, var, env)
            if value is not None:
                env[var["name"]] = value
        image = image_config(spec["image"])
        argv = [expand(arg, env) for arg in container_argv(spec, image)]
        mounts = {
            m["mountPath"]: (m["name"], m.get("subPath", ""))
            for m in spec.get("volumeMounts") or []
        }
        return Container(
            pod.name, spec["name"], argv, env, spec.get("workingDir", image.workdir), mounts, spec
        )

    def _source_data(self, pod: Pod, source: dict[str, Any]) -> dict[str, str]:
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                ref = source[key]
                obj = self.by_kind.get(kind, {}).get(ref["name"])
                if obj is None:
                    if ref.get("optional"):
                        return {}
                    raise KubeTranslationError(
                        f"{pod.name}: envFrom {kind} {ref['name']!r} is not rendered"
                    )
                return data_of(obj)
        raise KubeTranslationError(f"{pod.name}: envFrom {source}")

    def _env_value(
        self, pod: Pod, container: dict[str, Any], var: dict[str, Any], before: dict[str, str]
    ) -> str | None:
        """One `env` entry's value; `$(VAR)` in a `value` reads the variables `before` it."""
        if "valueFrom" not in var:
            return expand(var.get("value", ""), before)
        source = var["valueFrom"]
        for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
            if key in source:
                ref = source[key]
                obj = self.by_kind.get(kind, {}).get(ref["name"])
                data = data_of(obj) if obj else None
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise KubeTranslationError(
                        f"{pod.name}: {var['name']} reads {kind} {ref['name']!r} "
                        f"key {ref['key']!r}, "
                        "which is not rendered"
                    )
                return data[ref["key"]]
        if "fieldRef" in source:
            return pod.field(source["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in source:
            return _resource(container, source["resourceFieldRef"])
        raise KubeTranslationError(f"{pod.name}: {var['name']}'s valueFrom {source}")

    # --- Services

    def dns_names(self) -> dict[str, tuple[Pod, dict[int, int | str]]]:
        """Every Service name (each form) -> the pod it reaches and its port map (Service port ->
        target port); per-pod names of headless Services map ports to themselves."""
        names: dict[str, tuple[Pod, dict[int, int | str]]] = {}
        for service in self.by_kind.get("Service", {}).values():
            svc, ns = service["metadata"]["name"], _namespace(service)
            selector = service["spec"].get("selector") or {}
            selected = sorted(
                (
                    p
                    for p in self.pods
                    if p.namespace == ns and selector and selector.items() <= p.labels.items()
                ),
                key=lambda p: p.name,
            )
            ports = {
                int(p["port"]): p.get("targetPort", p["port"])
                for p in service["spec"].get("ports") or []
            }
            if selected:
                for name in _forms(svc, ns):
                    names[name] = (selected[0], ports)
            if service["spec"].get("clusterIP") == "None":
                for pod in selected:
                    if pod.subdomain == svc:
                        for name in _forms(f"{pod.hostname}.{svc}", ns):
                            names[name] = (pod, {})
        return names

    def service_pods(self, name: str) -> list[Pod]:
        service = self.by_kind["Service"][name]
        selector = service["spec"].get("selector") or {}
        return [p for p in self.pods if selector and selector.items() <= p.labels.items()]

    # --- NetworkPolicies (ingress; nothing here enforces them, a run checks what it saw)

    def ingress_allowed(self, source: Pod | None, target: Pod, port: int) -> bool:
        """Whether the NetworkPolicies admit a TCP connection from `source` (None: from
        outside the cluster's pods) to `target`'s `port`."""
        policies = [
            p
            for p in self.by_kind.get("NetworkPolicy", {}).values()
            if _namespace(p) == target.namespace
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
            and selects(p["spec"].get("podSelector") or {}, target.labels)
        ]
        if not policies:
            return True
        return any(
            _port_matches(rule.get("ports"), port, target)
            and _source_matches(rule.get("from"), source, _namespace(policy))
            for policy in policies
            for rule in policy["spec"].get("ingress") or []
        )


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against a set of labels."""
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        matched = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matched:
            return False
    return True


def _port_matches(ports: list[dict[str, Any]] | None, port: int, target: Pod) -> bool:
    if not ports:
        return True
    for rule in ports:
        if "port" not in rule:
            return True
        first = target_port(target.spec, rule["port"])
        if first <= port <= int(rule.get("endPort", first)):
            return True
    return False


def _source_matches(peers: list[dict[str, Any]] | None, source: Pod | None, namespace: str) -> bool:
    if not peers:
        return True
    for peer in peers:
        if "ipBlock" in peer:
            return True  # addresses outside the pod network, and any pod's: not told apart here
        if source is None:
            continue
        namespace_labels = {"kubernetes.io/metadata.name": source.namespace}
        if "namespaceSelector" in peer:
            in_namespace = selects(peer["namespaceSelector"], namespace_labels)
        else:
            in_namespace = source.namespace == namespace
        if in_namespace and selects(peer.get("podSelector") or {}, source.labels):
            return True
    return False


def target_port(pod_spec: dict[str, Any], target: int | str) -> int:
    """A Service's targetPort on one pod: a number, or the name of one of its container ports."""
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod_spec.get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    raise KubeTranslationError(f"no container port named {target!r}")


def data_of(obj: dict[str, Any]) -> dict[str, str]:
    """A ConfigMap's or Secret's keys as strings (a Secret's `data` is base64)."""
    if obj["kind"] == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return {**data, **{k: str(v) for k, v in (obj.get("stringData") or {}).items()}}
    return {k: str(v) for k, v in (obj.get("data") or {}).items()}


def _resource(container: dict[str, Any], ref: dict[str, Any]) -> str:
    kind, _, resource = ref["resource"].partition(".")
    value = str((container.get("resources") or {}).get(kind, {}).get(resource, "0"))
    if resource == "cpu":  # rounded up to whole cores, as the kubelet does with divisor 1
        cores = float(value[:-1]) / 1000 if value.endswith("m") else float(value)
        return str(max(1, -int(-cores // 1)))
    return value


def _namespace(obj: dict[str, Any]) -> str:
    return obj["metadata"].get("namespace", "default")


def _forms(name: str, ns: str) -> list[str]:
    return [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.{CLUSTER_DOMAIN}"]


def _expand(obj: dict[str, Any]) -> list[Pod]:
    kind, name, ns = obj["kind"], obj["metadata"]["name"], _namespace(obj)
    if kind == "Pod":
        meta = obj["metadata"]
        return [
            Pod(
                name,
                ns,
                f"Pod/{name}",
                dict(meta.get("labels") or {}),
                dict(meta.get("annotations") or {}),
                obj["spec"],
                obj["spec"].get("hostname", name),
                obj["spec"].get("subdomain"),
            )
        ]
    if kind == "LeaderWorkerSet":
        return _expand_lws(obj)
    spec = obj["spec"]
    template = spec["template"]
    meta = template.get("metadata") or {}
    replicas = int(spec.get("replicas", 1))
    pods = []
    template_hash = _hash(repr(template), 10)
    for index in range(replicas):
        labels = dict(meta.get("labels") or {})
        pod_name = f"{name}-{index}"
        if kind == "Deployment":  # a ReplicaSet's pod: <deployment>-<template hash>-<random>
            labels["pod-template-hash"] = template_hash
            pod_name = f"{name}-{template_hash}-{_hash(f'{name}/{index}', 5)}"
        hostname, subdomain, claims = pod_name, None, {}
        if kind == "StatefulSet":
            labels |= {POD_INDEX_LABEL: str(index), "statefulset.kubernetes.io/pod-name": pod_name}
            subdomain = spec.get("serviceName")
            claims = {
                t["metadata"]["name"]: f"{t['metadata']['name']}-{pod_name}"
                for t in spec.get("volumeClaimTemplates") or []
            }
        pods.append(
            Pod(
                pod_name,
                ns,
                f"{kind}/{name}",
                labels,
                dict(meta.get("annotations") or {}),
                template["spec"],
                hostname,
                subdomain,
                claims,
            )
        )
    return pods


def _hash(text: str, num_chars: int) -> str:
    """Kubernetes' name-safe alphabet (no vowels), deterministic here."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    value = int(hashlib.sha256(text.encode()).hexdigest(), 16)
    base = len(alphabet)
    return "".join(alphabet[(value // base**i) % base] for i in range(num_chars))


def _expand_lws(obj: dict[str, Any]) -> list[Pod]:
    """LeaderWorkerSet: `replicas` groups of `size`; the leader `<name>-<g>` (worker index 0)
    runs leaderTemplate (or workerTemplate), workers `<name>-<g>-<i>`; all share the headless
    Service `<name>` as subdomain and carry LWS's labels, with the leader's address in
    LWS_LEADER_ADDRESS as LWS injects it."""
    name, ns, spec = obj["metadata"]["name"], _namespace(obj), obj["spec"]
    lws = spec["leaderWorkerTemplate"]
    size = int(lws.get("size", 1))
    pods = []
    for group in range(int(spec.get("replicas", 1))):
        leader = f"{name}-{group}"
        for index in range(size):
            template = (
                lws.get("leaderTemplate")
                if index == 0 and lws.get("leaderTemplate")
                else lws["workerTemplate"]
            )
            meta = template.get("metadata") or {}
            pod_name = leader if index == 0 else f"{leader}-{index}"
            labels = dict(meta.get("labels") or {}) | {
                "leaderworkerset.sigs.k8s.io/name": name,
                "leaderworkerset.sigs.k8s.io/group-index": str(group),
                "leaderworkerset.sigs.k8s.io/worker-index": str(index),
            }
            pod_spec = _with_env(
                template["spec"],
                {
                    "LWS_LEADER_ADDRESS": f"{leader}.{name}.{ns}",
                    "LWS_GROUP_SIZE": str(size),
                    "LWS_WORKER_INDEX": str(index),
                },
            )
            pods.append(
                Pod(
                    pod_name,
                    ns,
                    f"LeaderWorkerSet/{name}",
                    labels,
                    dict(meta.get("annotations") or {}),
                    pod_spec,
                    pod_name,
                    name,
                )
            )
    return pods


def _with_env(pod_spec: dict[str, Any], extra: dict[str, str]) -> dict[str, Any]:
    injected = [{"name": k, "value": v} for k, v in extra.items()]
    containers = [
        {**c, "env": injected + list(c.get("env") or [])} for c in pod_spec.get("containers") or []
    ]
    return {**pod_spec, "containers": containers}


def quote(argv: list[str]) -> str:
    return shlex.join(argv)
