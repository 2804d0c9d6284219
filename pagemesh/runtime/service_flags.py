"""Every service option, declared once: name, type, default, help, choices, and which
services take it.

The declarations (`ServiceFlag`s, service_flags_base) live in service_flags_shared (options two
or more services take), service_flags_router, service_flags_scheduler and service_flags_worker;
here they are put together, looked up, and turned into the command line and environment
`pagemesh up` gives each service.

A service's `parse_args` adds its table (`ROUTER_OPTIONS`, `SCHEDULER_OPTIONS`,
`WORKER_OPTIONS`) with `pagemesh.runtime.config.add_options`, so each still reads its `PAGEMESH_*`
variable. `pagemesh up` adds every option once (`OPTIONS`; a flag two services take appears
once) and hands each service back the ones it takes (`options_argv`).

Not here: topology and per-process identity (ports, group, scheduler/worker/router id,
ranks, device, standby, Redis URL, cluster, host, TLS). Each service and `up` declare those
themselves, because `up` decides them per process.

Pure (no torch, no grpc, no service package): services import `pagemesh`, never the other
way round. The choice lists the services' cores define too (scheduling and routing
policies, preemption modes, quantization) are checked against these by
tests/pagemesh/test_service_flags.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pagemesh.runtime.service_flags_base import ROUTER, SCHEDULER, SERVICES, WORKER, ServiceFlag
from pagemesh.runtime.service_flags_router import ROUTER_ONLY_OPTIONS
from pagemesh.runtime.service_flags_scheduler import SCHEDULER_ONLY_OPTIONS
from pagemesh.runtime.service_flags_shared import SHARED_OPTIONS
from pagemesh.runtime.service_flags_worker import WORKER_ONLY_OPTIONS

OPTIONS: tuple[ServiceFlag, ...] = (
    *SHARED_OPTIONS,
    *ROUTER_ONLY_OPTIONS,
    *SCHEDULER_ONLY_OPTIONS,
    *WORKER_ONLY_OPTIONS,
)


def options_of(service: str) -> tuple[ServiceFlag, ...]:
    """The options `service` takes, in declaration order."""
    if service not in SERVICES:
        raise ValueError(f"no service {service!r}; one of {SERVICES}")
    return tuple(flag for flag in OPTIONS if service in flag.services)


ROUTER_OPTIONS = options_of(ROUTER)
SCHEDULER_OPTIONS = options_of(SCHEDULER)
WORKER_OPTIONS = options_of(WORKER)


def option(name: str) -> ServiceFlag:
    """The declaration of `--name`."""
    for flag in OPTIONS:
        if flag.name == name:
            return flag
    raise KeyError(name)


def options_argv(flags: Iterable[ServiceFlag], values: Mapping[str, Any]) -> list[str]:
    """The command line that gives each of `flags` its value in `values` (keyed by dest,
    as in `vars(args)`); secrets are left to `options_env`."""
    return [word for flag in flags for word in flag.argv(values[flag.dest])]


def options_env(flags: Iterable[ServiceFlag], values: Mapping[str, Any]) -> dict[str, str]:
    """The environment that gives each secret of `flags` its value in `values`: a list
    joined by spaces (a key holds none; pagemesh.runtime.auth splits them again)."""
    env = {}
    for flag in flags:
        value = values.get(flag.dest)
        if flag.secret and value:
            env[flag.env] = " ".join(map(str, value)) if flag.repeatable else str(value)
    return env


SECRET_DESTS = frozenset(flag.dest for flag in OPTIONS if flag.secret)
