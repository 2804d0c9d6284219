"""What a fault's checks compare against: the mesh as it was just before the fault
(`Baseline`, which the fault's steps also fill in: its victim, a drain's reply, notes for the
row), and the `Action` a prepared fault hands the runner to strike with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bench.faults.targets import Target
from pagemesh.runtime.registry_entries import SchedulerEntry

Action = Callable[[], None]


@dataclass
class Baseline:
    """What the mesh looked like just before the fault."""

    recoveries: int = 0
    scheduler_instance: str = ""
    router_instance: str = ""
    redis_run_id: str | None = None
    victim_pid: int = -1
    slow_steps: int = 0
    # The group whose health `detected` and `recovered` watch: the target's first, unless
    # the fault picks another.
    group: str = ""
    # Every group's scheduler entry before the fault, by group: its counters to compare.
    schedulers: dict[str, SchedulerEntry] = field(default_factory=dict)
    victim_host: str = ""  # the role of the host cut off the network
    # A drain's reply: (requests handed over with their KV, requests left to recompute).
    drained: tuple[int, int] | None = None
    tier_epoch: int = 0  # the epoch of the victim's host tier file
    notes: list[str] = field(default_factory=list)  # what `after` found, for the row

    @classmethod
    def of(cls, target: Target) -> Baseline:
        groups = target.groups_now()
        router = next(iter(target.entries("router").values()), None)
        base = cls(
            router_instance=router.instance if router else "",
            redis_run_id=target.redis_run_id(),
            schedulers=groups,
        )
        base.watch(target.groups[0], groups.get(target.groups[0]))
        return base

    def watch(self, name: str, group: SchedulerEntry | None) -> None:
        """From now on the fault's group is `name` (`group` its entry, None if absent)."""
        self.recoveries = group.num_recoveries if group else 0
        self.scheduler_instance = group.instance if group else ""
        self.slow_steps = group.num_slow_steps if group else 0
        self.group = name
