"""A local mesh driven from Python: `pagemesh up` started as a process tree (services, the
embedded Valkey), a gRPC client to its router, and Ctrl-C to stop it.

What the end-to-end tests and the benchmarks both start meshes with (`pagemesh up` itself is
`pagemesh/tools/local_mesh.py`); nothing here is a stub: real processes, real gRPC, real Valkey.

    mesh = Mesh(model_path, Path("mesh.log")).wait_ready()
    print(mesh.generate(greedy_request([1, 2, 3], max_tokens=8)).token_ids)
    mesh.stop()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.tls import TlsConfig
from pagemesh.tools import discovery
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc

# `pagemesh up` writes its state file once its embedded Valkey runs: a second or two.
STATE_FILE_TIMEOUT_S = 60.0


@dataclass
class Generation:
    """One streamed generation, its chunks joined."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    num_chunks: int = 0


class Mesh:
    """One `pagemesh up` process tree; `stop()` sends SIGINT like Ctrl-C would."""

    def __init__(
        self,
        model: str | None,
        log_path: Path,
        *,
        redis_url: str | None = None,
        cluster: str = "pagemesh",
        extra_args: list[str] | None = None,
        client_tls: TlsConfig | None = None,
        repo_root: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`client_tls`: how this client dials the router (plaintext by default);
        `env`: variables added to `up`'s environment (PAGEMESH_API_KEY, say);
        `repo_root`: the checkout whose services run, as the working directory of
        `python -m pagemesh.tools.cli up` (another one: a before/after benchmark); None: this
        process's working directory."""
        self.repo_root = repo_root
        self.log_path = log_path
        self._client_tls = client_tls or TlsConfig()
        # HTTP off unless a caller asks for it: parallel meshes would all want port 8000.
        extra_args = extra_args or []
        if "--http-port" not in extra_args:
            extra_args = [*extra_args, "--http-port", "0"]
        self._args = ["--cluster", cluster, "--log-level", "WARNING", *extra_args]
        if model is not None:
            self._args += ["--model", model]
        if redis_url is not None:
            self._args += ["--redis-url", redis_url]
        self._env = env or {}
        self._log = open(log_path, "wb")
        self._start()

    def _start(self) -> None:
        # `up --port 0`: `up` chooses the router's port (pagemesh.runtime.ports) and announces it in
        # its state file, which is read back here; no port is guessed on this side.
        argv = [sys.executable, "-m", "pagemesh.tools.cli", "up", "--port", "0", *self._args]
        self.process = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.repo_root,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self._env},
            start_new_session=True,
        )
        announced = self._announced(STATE_FILE_TIMEOUT_S)
        self.address = announced.router_address
        # Its Redis, password included (the state file is the owner's alone; logs redact it).
        self.redis_url = announced.redis_url
        self.port = int(self.address.rsplit(":", 1)[1])
        self.channel = self._client_tls.channel(self.address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def _announced(self, timeout_s: float) -> discovery.LocalMesh:
        """What `pagemesh up` wrote in its state file, once it has."""
        path = discovery.state_dir() / f"{self.process.pid}.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"pagemesh up exited with {self.process.returncode} before "
                    f"announcing itself:\n{self.log()}"
                )
            try:
                return discovery.LocalMesh.from_json(json.loads(path.read_text()), str(path))
            except (OSError, ValueError):  # not written yet (it appears in one rename)
                time.sleep(0.05)
        raise TimeoutError(f"pagemesh up wrote no {path} in {timeout_s} s:\n{self.log()}")

    def wait_ready(self, timeout_s: float = 300.0) -> Mesh:
        """Waits for the router's health to say SERVING."""
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"pagemesh up exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"mesh not ready after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        """The last 6,000 characters of the mesh's log."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def generate(self, request: generate_pb2.GenerateRequest, timeout_s: float = 300) -> Generation:
        return generate(self.stub, request, timeout_s)

    def child_pids(self) -> list[int]:
        """Processes `pagemesh up` started (services and the embedded Valkey)."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in path.read_text().split()] if path.exists() else []

    def stop(self, timeout_s: float = 30.0) -> int:
        """Ctrl-C: SIGINT to the whole process group, as a terminal sends it.

        Raises if any process `pagemesh up` started outlives it.
        """
        self.channel.close()
        children = self.child_pids()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        survivors = [pid for pid in children if alive(pid)]
        if survivors:
            raise AssertionError(f"processes outlived `pagemesh up`: {survivors}")
        return self.process.returncode


def generate(
    stub: generate_pb2_grpc.GenerationStub,
    request: generate_pb2.GenerateRequest,
    timeout_s: float = 300,
) -> Generation:
    """One `Generate` stream through a router, its chunks joined."""
    result = Generation()
    for chunk in stub.Generate(request, timeout=timeout_s):
        result.num_chunks += 1
        result.token_ids.extend(chunk.token_ids)
        result.text += chunk.text
        result.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            result.finish_reason = chunk.finish_reason
            result.prompt_tokens = chunk.usage.prompt_tokens
            result.completion_tokens = chunk.usage.completion_tokens
    return result


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie awaiting its parent's wait() does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def greedy_request(
    prompt_ids: list[int], max_tokens: int, **kwargs: object
) -> generate_pb2.GenerateRequest:
    """Exactly `max_tokens` greedy tokens after `prompt_ids` (EOS ignored): the request whose
    output is a pure function of the model, as benchmarks and tests want it."""
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt_ids), **kwargs
    )
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    return request
