"""What a container sees -> what this process sees: the translation of a container's argv,
environment, working directory and probe commands into a local process's (tests/support/
kube_runner.py's docstring says what is translated, and how). `LocalizeMixin` is a part of
`KubeRun`, which sets the attributes it reads."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pagemesh.tools.testing.netns import HostNetwork
from tests.support.kube_pods import Container, KubeTranslationError, Pod, target_port
from tests.support.paths import REPO_ROOT

IMAGE_ROOT = "/opt/pagemesh"
LOOPBACK_HOSTS = ("0.0.0.0", "127.0.0.1", "localhost")
_URL = re.compile(r"\b([a-z][a-z0-9+.-]*://[^\s,;\"']+)")
_HOST_PORT = re.compile(r"(?<![\w./@:-])([A-Za-z0-9][A-Za-z0-9.-]*):(\d{1,5})(?![\w.])")
_HOST_FLAG = re.compile(r"^--[a-z-]*(host|addr|address|url|endpoint)$")
_CLUSTER_NAME = re.compile(r"^[a-z0-9-]+(\.[a-z0-9-]+)*\.svc(\.cluster\.local)?$")


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


class LocalizeMixin:
    """Translates containers into local processes, for `KubeRun`."""

    model: Path | None  # the test's model, in place of PAGEMESH_MODEL / --model
    run_dir: Path
    network: HostNetwork | None  # None: the pods share this machine's loopback
    dns: dict  # a Service's DNS name -> (the pod it reaches, its ports)

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
