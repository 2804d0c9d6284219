"""The kubelet's part of running pods as local processes: init containers to completion,
containers started in their pod's network namespace and restarted per restartPolicy, the
readiness probes run as the kubelet runs them, and `stop()` as deleting every pod at once
(preStop hooks, SIGTERM, SIGKILL after the grace period). `KubeletMixin` is a part of
`KubeRun` (tests/support/kube_runner.py), which sets the attributes it reads."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.compose_runner import PRIVATE_PREFIXES
from tests.support.kube_localize import Running
from tests.support.kube_pods import Pod, target_port

MIN_EXEC_PROBE_TIMEOUT_S = 10.0  # a `pagemesh health` process starts slowly on a busy machine


@dataclass
class Stopped:
    """How a container ended under `stop()`: its exit status, seconds after SIGTERM, and
    whether it had to be SIGKILLed after its pod's grace period."""

    returncode: int
    seconds: float
    killed: bool


class KubeletMixin:
    """Starts, watches, probes and stops the containers of `KubeRun`; it calls KubeRun's
    `pods` and `log_tails`, and `_probe_argv` of its LocalizeMixin."""

    run_dir: Path  # logs/ holds each container's log
    running: dict[str, Running]  # "pod/container"
    namespaces: dict[str, str]  # pod -> network namespace (none on the loopback)
    extra_env: dict[str, str]
    events: list[str]
    _logs: list[TextIO]
    _stopping: bool
    _lock: threading.Lock
    _kubelet: threading.Thread  # runs `_watch`

    # --- start

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

    # --- watch

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

    # --- stop

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
