"""`pagemesh up --cpu-bind`: the plan (pure), the host's cores read from sysfs, what `up`
gives each service, and that a process started that way runs where it was put."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pagemesh.tools import cli
from pagemesh.tools.cpu_placement import host_cores, omp_wait_env, plan_placement
from pagemesh.tools.local_mesh import service_specs
from pagemesh.tools.supervisor import ServiceSpec, Supervisor

ONE_THREAD_CORES = [(cpu,) for cpu in range(8)]
SMT_CORES = [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15)]


def test_auto_reserves_a_core_only_on_hosts_with_four_or_more():
    assert plan_placement("auto", ONE_THREAD_CORES[:2], 1).mode == "none"
    assert plan_placement("auto", ONE_THREAD_CORES[:3], 1).workers is None
    four = plan_placement("auto", ONE_THREAD_CORES[:4], 1)
    assert (four.mode, four.workers, four.control) == ("reserve", ((1, 2, 3),), (0,))
    # Four cores cannot give four workers and the control plane one each: unbound.
    assert plan_placement("auto", ONE_THREAD_CORES[:4], 4).mode == "none"


def test_reserve_gives_workers_one_thread_per_physical_core_and_the_rest_to_the_control_plane():
    plan = plan_placement("reserve", SMT_CORES, 2)
    assert plan.workers == ((1, 2, 3), (4, 5, 6))  # first siblings only
    assert plan.control == (0, 8, 7, 15)  # core 0 with its sibling, and the core left over
    assert plan.worker_env(1) == {
        "OMP_NUM_THREADS": "3",
        "OMP_PROC_BIND": "close",
        "OMP_PLACES": "{4},{5},{6}",
    }
    assert "worker slot 1: CPUs 4,5,6" in plan.describe()


def test_pin_binds_workers_over_every_core_and_leaves_the_control_plane_free():
    plan = plan_placement("pin", ONE_THREAD_CORES[:2], 1)
    assert (plan.workers, plan.control) == (((0, 1),), None)
    assert plan_placement("pin", SMT_CORES, 3).workers == ((0, 1), (2, 3), (4, 5))
    none = plan_placement("none", SMT_CORES, 1)
    assert (none.workers, none.control, none.worker_env(0)) == (None, None, {})


def test_a_binding_the_cores_cannot_give_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 3 physical cores .* may use 2"):
        plan_placement("reserve", ONE_THREAD_CORES[:2], 2)
    with pytest.raises(ValueError, match="needs 3 physical cores"):
        plan_placement("pin", ONE_THREAD_CORES[:2], 3)
    with pytest.raises(ValueError, match="must be one of"):
        plan_placement("numa", ONE_THREAD_CORES, 1)


def _topology(root: Path, cpu: int, package: int, core: int) -> None:
    folder = root / f"cpu{cpu}" / "topology"
    folder.mkdir(parents=True)
    (folder / "physical_package_id").write_text(f"{package}\n")
    (folder / "core_id").write_text(f"{core}\n")


def test_host_cores_groups_smt_siblings_by_package_and_core(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (1, 0), (0, 0), (0, 1), (1, 0)]):
        _topology(tmp_path, cpu, package, core)
    assert host_cores({0, 1, 2, 3, 4, 5}, tmp_path) == [(0, 3), (1, 4), (2, 5)]
    assert host_cores({1, 2, 4}, tmp_path) == [(1, 4), (2,)]  # only the allowed CPUs
    assert host_cores({0, 7}, tmp_path) == [(0,), (7,)]  # no topology: a core of its own
    assert sum(len(core) for core in host_cores()) == len(os.sched_getaffinity(0))


def test_up_gives_each_worker_its_cores_and_threads(monkeypatch):
    monkeypatch.setattr("pagemesh.tools.local_mesh.host_cores", lambda: ONE_THREAD_CORES[:7])
    args = cli.build_parser().parse_args(
        ["up", "--tp", "2", "--standby", "1", "--cpu-bind", "reserve"]
    )
    specs = {spec.name: spec for spec in service_specs(args, "m", "redis://127.0.0.1:1/0")}
    assert specs["worker-g0-pp0-tp0"].cpus == (1, 2, 3)
    assert specs["worker-g0-pp0-tp1"].cpus == (4, 5, 6)
    assert specs["worker-g0-standby0"].cpus == (1, 2, 3)  # stands in for a rank: its cores
    assert specs["worker-g0-pp0-tp1"].env["OMP_PLACES"] == "{4},{5},{6}"
    tp1 = specs["worker-g0-pp0-tp1"].args
    assert tp1[tp1.index("--torch-threads") + 1] == "3"
    assert specs["router"].cpus is None and "OMP_PLACES" not in specs["scheduler-g0"].env
    for argv in (["--cpu-bind", "none"], ["--device", "cuda", "--cpu-bind", "reserve"]):
        args = cli.build_parser().parse_args(["up", *argv])
        specs = {spec.name: spec for spec in service_specs(args, "m", "redis://127.0.0.1:1/0")}
        assert specs["worker-g0-pp0-tp0"].cpus is None
        assert "OMP_PLACES" not in specs["worker-g0-pp0-tp0"].env


def test_idle_openmp_threads_spin_unless_told_to_sleep():
    assert omp_wait_env("spin") == {}  # the runtime's spin-then-sleep
    assert omp_wait_env("passive") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_wait_env("30000") == {"GOMP_SPINCOUNT": "30000"}  # libgomp's spins, then sleep
    for wrong in ("active", "-5", "3e4", ""):
        with pytest.raises(ValueError, match="--omp-wait must be one of"):
            omp_wait_env(wrong)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["up", "--omp-wait", "-5"])
    args = cli.build_parser().parse_args(["up", "--omp-wait", "30000"])
    specs = {spec.name: spec for spec in service_specs(args, "m", "redis://127.0.0.1:1/0")}
    assert specs["worker-g0-pp0-tp0"].env["GOMP_SPINCOUNT"] == "30000"
    args = cli.build_parser().parse_args(["up", "--omp-wait", "passive"])
    specs = {spec.name: spec for spec in service_specs(args, "m", "redis://127.0.0.1:1/0")}
    assert specs["worker-g0-pp0-tp0"].env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in specs["router"].env
    args = cli.build_parser().parse_args(["up"])
    specs = {spec.name: spec for spec in service_specs(args, "m", "redis://127.0.0.1:1/0")}
    assert "OMP_WAIT_POLICY" not in specs["worker-g0-pp0-tp0"].env


def test_a_process_the_supervisor_binds_runs_one_thread_on_each_of_its_cpus(tmp_path):
    plan = plan_placement("pin", host_cores(), 1)  # every core of this host, any count
    cpus = plan.workers[0]
    out = tmp_path / "probe.json"
    child = Supervisor().start(
        ServiceSpec("probe", "tests.support.affinity_probe", [str(out)], plan.worker_env(0), cpus)
    )
    assert child.wait(timeout=120) == 0
    report = json.loads(out.read_text())
    assert report["affinity"] == sorted(cpus)
    assert report["torch_threads"] == len(cpus)
    # The OpenMP team: one thread bound to each CPU (the first one the loading thread).
    assert {tuple(t) for t in report["threads"]} >= {(cpu,) for cpu in cpus}
