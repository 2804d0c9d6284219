"""What is noticed, and when it is over: the conditions a scenario's watcher polls as
`detected` and `recovered`, each judged from outside as an operator would (the registry, the
router's health, the processes) against the `Baseline` recorded before the fault."""

from __future__ import annotations

from bench.faults.baseline import Baseline
from bench.faults.targets import Target
from pagemesh.runtime.registry_entries import GroupStatus
from pagemesh.tools.mesh_process import alive


def group_degraded(target: Target, base: Baseline) -> bool:
    group = target.group(base.group)
    return (
        group is None or group.status != GroupStatus.READY or group.num_recoveries > base.recoveries
    )


def group_recovered(target: Target, base: Baseline) -> bool:
    group = target.group(base.group)
    return (
        group is not None
        and group.status == GroupStatus.READY
        and group.num_recoveries > base.recoveries
    )


def group_draining(target: Target, base: Baseline) -> bool:
    group = target.group(base.group)
    return group is not None and group.status == GroupStatus.DRAINING


def handed_over(target: Target, base: Baseline) -> bool:
    """The drain has answered and the drained group's entry, published since, shows it
    running nothing: every request it ran went on elsewhere (a heartbeat late)."""
    group = target.group(base.group)
    return (
        base.drained is not None
        and group is not None
        and group.status == GroupStatus.DRAINING
        and group.num_running == 0
    )


def router_sees_no_group(target: Target, base: Baseline) -> bool:
    return not target.router_serving()


def new_scheduler_serving(target: Target, base: Baseline) -> bool:
    group = target.group()
    return (
        group is not None
        and group.instance != base.scheduler_instance
        and group.status == GroupStatus.READY
        and target.router_serving()
    )


def victim_gone(target: Target, base: Baseline) -> bool:
    return not alive(base.victim_pid)


def new_router_serving(target: Target, base: Baseline) -> bool:
    router = next(iter(target.entries("router").values()), None)
    return (
        router is not None and router.instance != base.router_instance and target.router_serving()
    )


def redis_back(target: Target, base: Baseline) -> bool:
    run_id = target.redis_run_id()
    return run_id is not None and run_id != base.redis_run_id


def everyone_registered(target: Target, base: Baseline) -> bool:
    return (
        redis_back(target, base)
        and target.group() is not None
        and bool(target.entries("router"))
        and bool(target.entries("worker"))
    )


def never(target: Target, base: Baseline) -> bool:
    return False
