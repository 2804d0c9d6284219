"""`pagemesh up`: one embedded Valkey, one scheduler, one worker and the router, locally.

Each service is its own process, started by module name with the same flags the compose
files pass; they find each other through Redis. Ctrl-C (or SIGTERM) stops all of them.
While it runs, it announces its Redis URL, cluster and router address in a state file
(pagemesh/tools/discovery.py), so that `pagemesh top`, `health`, `admin` and `profile` find it
with no flags.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.config import tls_config, with_password
from pagemesh.runtime.host_tier_files import remove_tier_files
from pagemesh.runtime.logs import setup_logging
from pagemesh.runtime.models import default_model_path
from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.redact import redact_url
from pagemesh.runtime.service_flags import (
    ROUTER_OPTIONS,
    SCHEDULER_OPTIONS,
    WORKER_OPTIONS,
    options_argv,
    options_env,
)
from pagemesh.runtime.service_flags_worker import expert_parallel_error
from pagemesh.runtime.tls import TlsConfig
from pagemesh.tools import discovery
from pagemesh.tools.cpu_placement import Placement, host_cores, omp_wait_env, plan_placement
from pagemesh.tools.embedded_valkey import EmbeddedValkey
from pagemesh.tools.liveness import LivenessProbe
from pagemesh.tools.malloc_preload import find_malloc, preload_env
from pagemesh.tools.supervisor import ServiceSpec, Supervisor

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0


def served_model_name(model_path: str) -> str:
    path = Path(model_path)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def engine_groups(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, role) of each engine group: `--replicas` colocated ones ("g0", ...), or with
    --prefill-replicas / --decode-replicas that many of each ("prefill0", ..., "decode0",
    ...). Raises ValueError for a disaggregated layout missing one side."""
    prefill, decode = (getattr(args, "prefill_replicas", 0), getattr(args, "decode_replicas", 0))
    if not (prefill or decode):
        return [(f"g{i}", "both") for i in range(args.replicas)]
    if prefill < 1 or decode < 1:
        raise ValueError(
            "disaggregated serving needs --prefill-replicas and --decode-replicas both >= 1"
        )
    return [(f"prefill{i}", "prefill") for i in range(prefill)] + [
        (f"decode{i}", "decode") for i in range(decode)
    ]


def _num_workers(args: argparse.Namespace) -> int:
    return (args.tp * args.pp + args.standby) * len(engine_groups(args))


def cpu_placement(args: argparse.Namespace) -> Placement:
    """Where the CPU workers and the control plane run (`--cpu-bind`,
    pagemesh/tools/cpu_placement.py):
    one slot per rank of each replica, standbys sharing their replica's first slot.
    Raises ValueError when the mode cannot be given on this host."""
    if args.device != "cpu":
        return Placement(None, None, "none")
    return plan_placement(args.cpu_bind, host_cores(), args.tp * args.pp * len(engine_groups(args)))


def _option_values(args: argparse.Namespace, model: str, placement: Placement) -> dict[str, Any]:
    """`up`'s parsed options, with what `up` decides for its services: the model it
    resolved and its name, and on CPU each worker's share of the host."""
    values = {
        **vars(args),
        "model": model,
        "served_model_name": args.served_model_name or served_model_name(model),
    }
    num_workers = _num_workers(args)
    if args.device == "cpu":  # the host's memory is shared: each worker sizes its own part
        values["cpu_kv_cache_fraction"] = args.cpu_kv_cache_fraction / num_workers
    if placement.workers is not None and not args.torch_threads:
        values["torch_threads"] = len(placement.workers[0])  # one per bound core
    elif num_workers > 1 and args.device == "cpu" and not args.torch_threads:
        # Share the cores, don't each claim all.
        values["torch_threads"] = max(1, (os.cpu_count() or 1) // num_workers)
    return values


def service_specs(
    args: argparse.Namespace, model: str, redis_url: str, placement: Placement | None = None
) -> list[ServiceSpec]:
    """`--replicas` engine groups (each tp x pp workers and a scheduler) and the router.
    Each service gets every option it takes (pagemesh.runtime.service_flags), as the compose files
    pass them too, and the topology and identity `up` decides per process."""
    placement = placement or cpu_placement(args)  # up plans it before binding itself
    values = _option_values(args, model, placement)
    # Only the router serves clients on --host; schedulers and workers bind the address they
    # advertise (127.0.0.1 under `--host 0.0.0.0`): nobody else needs to reach them.
    common = ["--cluster", args.cluster, *tls_config(args).flags()]
    internal = [*common, "--host", _dial_host(args.host)]
    # The URL may carry a password (the embedded Valkey's does), and the secrets (API keys,
    # the internal token) are secrets: the environment, not argv.
    env = {"PAGEMESH_REDIS_URL": redis_url}
    worker_env = {**env, **options_env(WORKER_OPTIONS, values)}
    if args.device == "cpu":
        worker_env |= preload_env(find_malloc(args.malloc)) | omp_wait_env(args.omp_wait)
    scheduler_env = {**env, **options_env(SCHEDULER_OPTIONS, values)}
    worker = options_argv(WORKER_OPTIONS, values)
    scheduler = options_argv(SCHEDULER_OPTIONS, values)
    router = [
        *options_argv(ROUTER_OPTIONS, values),
        "--port",
        str(args.port),
        "--http-port",
        str(args.http_port),
    ]
    layout = ["--tp", str(args.tp), "--pp", str(args.pp)]
    world = args.tp * args.pp

    def device(replica: int, pp: int, tp: int) -> str:
        return f"cuda:{replica * world + pp * args.tp + tp}" if args.device == "cuda" else "cpu"

    def worker_spec(name: str, argv: list[str], slot: int) -> ServiceSpec:
        cpus = None if placement.workers is None else placement.workers[slot]
        return ServiceSpec(
            name,
            "worker_svc.main",
            [*internal, *worker, *layout, *argv],
            worker_env | placement.worker_env(slot),
            cpus,
        )

    specs = []
    for replica, (name, role) in enumerate(engine_groups(args)):
        group = ["--group", name]
        specs += [
            worker_spec(
                f"worker-{name}-pp{pp}-tp{tp}",
                [
                    *group,
                    "--tp-rank",
                    str(tp),
                    "--pp-rank",
                    str(pp),
                    "--device",
                    device(replica, pp, tp),
                ],
                replica * world + pp * args.tp + tp,
            )
            for pp in range(args.pp)
            for tp in range(args.tp)
        ]
        # A standby of a one-worker group is just a second worker: loaded and ready, it is
        # picked when the first dies. In a bigger group it waits for whichever rank is lost.
        standby = [] if world == 1 else ["--standby"]
        specs += [
            worker_spec(
                f"worker-{name}-standby{i}",
                [*group, *standby, "--device", device(replica, 0, 0)],
                replica * world,
            )
            for i in range(args.standby)
        ]
        specs.append(
            ServiceSpec(
                f"scheduler-{name}",
                "scheduler_svc.main",
                [*internal, *scheduler, *layout, *group, "--role", role],
                scheduler_env,
            )
        )
    specs.append(
        ServiceSpec(
            "router",
            "router.main",
            [*common, "--host", args.host, *router],
            {**env, **options_env(ROUTER_OPTIONS, values)},
        )
    )  # keys: not argv
    return specs


def _router_serving(address: str, tls: TlsConfig) -> bool:
    with tls.channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def _wait_until_ready(
    supervisor: Supervisor, address: str, tls: TlsConfig, stop: list[bool]
) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and not stop:
        if supervisor.dead_children():
            return False
        if _router_serving(address, tls):
            return True
        time.sleep(0.5)
    return False


def _dial_host(host: str) -> str:
    """Where a local client reaches services bound on `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _announce(args: argparse.Namespace, redis_url: str, tls: TlsConfig) -> Path | None:
    """The state file the commands find this mesh by; None (and a warning) if it cannot be
    written: the mesh serves anyway, the commands then need their flags."""
    host = _dial_host(args.host)
    scheme = "https" if tls.serves_tls else "http"
    mesh = discovery.LocalMesh(
        pid=os.getpid(),
        redis_url=redis_url,
        cluster=args.cluster,
        router_address=f"{host}:{args.port}",
        http_url=f"{scheme}://{host}:{args.http_port}/v1" if args.http_port else "",
        started_at=time.time(),
    )
    try:
        return discovery.announce(mesh)
    except OSError as exc:
        logger.warning(
            "could not write the local mesh's state file (%s): `pagemesh top` and "
            "the admin commands will need --redis-url / --address",
            exc,
        )
        return None


def run_up(args: argparse.Namespace) -> int:
    setup_logging("pagemesh", args.log_level)
    model = args.model or default_model_path()
    tls = tls_config(args)  # fails early on a missing file, before anything starts
    problem = expert_parallel_error(args.enable_expert_parallel, args.eplb_interval_steps)
    if problem:
        raise SystemExit(problem)
    try:
        engine_groups(args)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    placement = Placement(None, None, "none")
    if args.device == "cpu":
        try:  # a named allocator that is not installed: said before anything starts
            library = find_malloc(args.malloc)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        logger.info(
            "CPU workers preload %s (--malloc %s)", library or "no allocator (glibc's)", args.malloc
        )
        try:  # the same for a binding this host cannot give
            placement = cpu_placement(args)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        logger.info(
            "--cpu-bind %s: %s; --omp-wait %s", args.cpu_bind, placement.describe(), args.omp_wait
        )
        if placement.control is not None:  # up, Valkey, the router and schedulers inherit it
            os.sched_setaffinity(0, placement.control)
    if not args.internal_token:  # schedulers and workers answer only this mesh's services
        args.internal_token = secrets.token_urlsafe(24)
    if args.port == 0:
        # Chosen once, here, not bound by the router: a restarted router (and so its
        # clients, resuming) must find the same port, and no bind(0) can take this one.
        args.port = reserve_port(_dial_host(args.host))
    embedded = None
    if args.redis_password and not args.redis_url:
        raise SystemExit(
            "--redis-password is the password of --redis-url's user: give the "
            "URL too (the embedded Valkey makes its own password)"
        )
    redis_url = with_password(args.redis_url, args.redis_password) if args.redis_url else None
    if redis_url is None:
        embedded = EmbeddedValkey(reserve_port()).start()
        redis_url = embedded.url
        logger.info("embedded Valkey at %s", redact_url(redis_url))
    supervisor = Supervisor()
    stop: list[bool] = []

    def request_stop(signum: int, frame: object) -> None:
        stop.append(True)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    exit_code = 0
    # A child alive but not running (frozen, wedged) is killed, then restarted below.
    liveness = LivenessProbe(redis_url, args.cluster, supervisor.pids, tls)
    announced: Path | None = None
    try:
        announced = _announce(args, redis_url, tls)
        for spec in service_specs(args, model, redis_url, placement):
            supervisor.start(spec)
        liveness.start()
        address = f"{args.host}:{args.port}"
        ready = _wait_until_ready(supervisor, address, tls, stop)
        if ready:
            http = (
                f"  HTTP  {'https' if tls.serves_tls else 'http'}://{args.host}:{args.http_port}/v1"
                "  (OpenAI-compatible)\n"
                if args.http_port
                else ""
            )
            print(
                f"pagemesh is up: model {model}\n"
                f"  gRPC  {address}  (pagemesh.v1.Generation, reflection on)\n{http}"
                f'  try   pagemesh generate --chat "What is the capital of France?"\n'
                f"        pagemesh top; pagemesh admin memory (found with no flags)\n"
                f"  Redis {redact_url(redis_url)}\nCtrl-C stops every process.",
                flush=True,
            )
        while ready and not stop:
            supervisor.restart_dead()  # the rest of the mesh serves on meanwhile
            if embedded is not None:  # restarted if it exited; waited for if it is frozen
                embedded.check()
            if "router" in supervisor.given_up:
                logger.error("the router keeps dying; stopping the mesh")
                exit_code = 1
                break
            time.sleep(0.2)
        if not ready and not stop:
            logger.error(
                "service(s) exited before the mesh was ready: %s; stopping it",
                supervisor.dead_children(),
            )
            exit_code = 1
    finally:
        if announced is not None:
            discovery.withdraw(announced)
        liveness.stop()
        supervisor.stop()
        if args.host_tier_gib > 0:  # the host KV tiers outlive their workers, not the mesh
            remove_tier_files(args.host_tier_dir, args.cluster)
        if embedded is not None:
            embedded.stop()
    return exit_code
