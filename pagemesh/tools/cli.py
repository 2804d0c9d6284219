"""The `pagemesh` command: `up` starts a local mesh, `generate` streams from a router,
`top` shows a running cluster, `health` checks one service (for container health checks),
`admin` and `profile` call the router's Admin service (pagemesh/tools/admin.py), `bench` loads a
running router with a named workload (code in pagemesh/tools/loadgen), `secrets` writes a deployed
mesh's shared secrets (pagemesh/tools/mesh_secrets.py). `top`, `health`, `admin`
and `profile` find a local `pagemesh up` with no flags (pagemesh/tools/discovery.py)."""

from __future__ import annotations

import argparse
import itertools
import logging
import sys

from pagemesh.runtime.config import add_flag, add_options, add_redis_password_flag, add_tls_flags
from pagemesh.runtime.service_flags import OPTIONS
from pagemesh.runtime.service_flags_base import SERVICES
from pagemesh.tools import generate as client
from pagemesh.tools import local_mesh
from pagemesh.tools.admin import add_admin_parser, add_profile_parser
from pagemesh.tools.cpu_placement import CPU_BIND_CHOICES, omp_wait_flag
from pagemesh.tools.health import add_health_parser
from pagemesh.tools.loadgen.cli import add_bench_parser
from pagemesh.tools.malloc_preload import MALLOC_CHOICES
from pagemesh.tools.mesh_secrets import add_secrets_parser
from pagemesh.tools.top import add_top_parser

logger = logging.getLogger(__name__)


def _add_up_parser(sub: argparse._SubParsersAction) -> None:
    """`up` declares only the topology; every service option comes from
    pagemesh.runtime.service_flags, once, and goes to each service that takes it."""
    up = sub.add_parser(
        "up", help="start Redis (embedded), a scheduler, its tp x pp workers and the router"
    )
    add_flag(
        up,
        "--port",
        type=int,
        default=50051,
        help="router gRPC port (0 = one from pagemesh.runtime.ports, kept across router restarts, "
        "written to the state file and the ready line)",
    )
    add_flag(
        up,
        "--http-port",
        type=int,
        default=8000,
        help="router OpenAI-compatible HTTP port (0 = off)",
    )
    add_flag(up, "--host", default="127.0.0.1", help="address the services bind")
    add_flag(
        up,
        "--redis-url",
        default=None,
        help="use this Redis instead of an embedded Valkey (redis:// or rediss://)",
    )
    add_redis_password_flag(up)
    add_flag(up, "--cluster", default="pagemesh", help="key prefix of this mesh in Redis")
    add_flag(
        up,
        "--replicas",
        type=int,
        default=1,
        help="engine groups (data parallelism), each a scheduler and its tp x pp workers",
    )
    add_flag(
        up,
        "--prefill-replicas",
        type=int,
        default=0,
        help="disaggregated serving: engine groups that only prefill (each new "
        "request's prompt and first token), handing its KV to a decode group; "
        "with --decode-replicas, instead of --replicas",
    )
    add_flag(
        up,
        "--decode-replicas",
        type=int,
        default=0,
        help="disaggregated serving: engine groups that continue the requests the "
        "prefill groups hand over, pulling their KV",
    )
    add_flag(
        up,
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where workers run; with cuda, worker i of this host takes GPU i",
    )
    add_flag(
        up,
        "--standby",
        type=int,
        default=0,
        help="spare workers per engine group, taking over from one that dies",
    )
    add_flag(up, "--tp", type=int, default=1, help="tensor-parallel workers per pipeline stage")
    add_flag(up, "--pp", type=int, default=1, help="pipeline stages")
    add_flag(
        up,
        "--malloc",
        default="auto",
        choices=MALLOC_CHOICES,
        help="allocator preloaded into CPU workers: auto = tcmalloc, else jemalloc, when "
        "installed (Debian libtcmalloc-minimal4 / libjemalloc2), else glibc's; "
        "system = glibc's",
    )
    add_flag(
        up,
        "--cpu-bind",
        default="auto",
        choices=CPU_BIND_CHOICES,
        help="CPU workers' threads bound one per physical core: reserve = the control "
        "plane (router, schedulers, Valkey) keeps the first core, the workers share "
        "the rest; pin = workers over every core; none = unbound; auto = reserve "
        "with 4 cores or more, else none",
    )
    add_flag(
        up,
        "--omp-wait",
        type=omp_wait_flag,
        default="spin",
        help="how CPU workers' idle OpenMP threads wait: spin = the runtime's "
        "spin-then-sleep (fastest steps); passive = sleep at once, leaving shared "
        "cores to the router and schedulers (for models far cheaper than their "
        "traffic); a number = spin that many times, then sleep (GOMP_SPINCOUNT)",
    )
    for services, flags in itertools.groupby(OPTIONS, key=lambda flag: flag.services):
        title = "every service" if len(services) == len(SERVICES) else " and ".join(services)
        add_options(up.add_argument_group(f"options of {title}"), flags)
    add_tls_flags(up)  # every service gets them; the certificate must name --host
    up.set_defaults(func=local_mesh.run_up)


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream a completion from a running router")
    gen.add_argument("prompt", help="prompt text")
    add_flag(gen, "--address", default="127.0.0.1:50051", help="router host:port")
    add_flag(gen, "--max-tokens", type=int, default=None, help="tokens to generate at most")
    add_flag(gen, "--temperature", type=float, default=0.0, help="0 = greedy")
    add_flag(gen, "--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
    add_flag(gen, "--top-k", type=int, default=0, help="0 = off")
    add_flag(gen, "--seed", type=int, default=None, help="seed of the random draws")
    add_flag(gen, "--stop", action="append", default=None, help="stop string (repeatable)")
    add_flag(
        gen,
        "--chat",
        type=bool,
        default=False,
        help="send the prompt as one user message through the chat template",
    )
    add_flag(gen, "--usage", type=bool, default=False, help="print token counts at the end")
    add_flag(gen, "--api-key", default=None, help="sent as `authorization: Bearer <key>`")
    add_tls_flags(gen)  # --tls-ca: dial TLS; --tls-cert/--tls-key: the client certificate
    gen.set_defaults(func=client.run_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagemesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up_parser(sub)
    _add_generate_parser(sub)
    add_top_parser(sub)
    add_health_parser(sub)
    add_admin_parser(sub)
    add_profile_parser(sub)
    add_bench_parser(sub)
    add_secrets_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
