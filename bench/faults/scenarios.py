"""The fault matrix's scenarios: what is done to a running mesh, and when the mesh has
noticed (detected) and got over it (recovered), judged from outside as an operator would:
the registry, the router's health, the processes.

Each fault is prepared before the streams start (`prepare` picks its victim while the mesh
is calm) and returns the action the runner takes mid-stream; the watcher then polls
`detected` and `recovered` against the state `baseline` recorded before the fault.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.faults.targets import Target
from pagemesh.mesh_process import alive
from pagemesh.registry_entries import GroupStatus

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

    @classmethod
    def of(cls, target: Target) -> Baseline:
        group = target.group()
        router = next(iter(target.entries("router").values()), None)
        return cls(group.num_recoveries if group else 0, group.instance if group else "",
                   router.instance if router else "", target.redis_run_id(),
                   slow_steps=group.num_slow_steps if group else 0)


@dataclass(frozen=True)
class Scenario:
    name: str  # the table's row
    target: str  # which mesh (bench/faults/targets.py)
    prepare: Callable[[Target, Baseline], Action]
    detected: Callable[[Target, Baseline], bool]
    recovered: Callable[[Target, Baseline], bool]
    # Checked once the streams ended: raises AssertionError when something is wrong.
    after: Callable[[Target, Baseline], None] = lambda target, baseline: None
    notes: str = ""
    # Detection is by design absent (no fault, or a healthy long step that must not alarm).
    no_fault: bool = False
    tags: tuple[str, ...] = field(default_factory=tuple)


def _signal(pid: int, signum: int) -> Action:
    return lambda: os.kill(pid, signum)


# --- what is noticed, and when it is over -----------------------------------------------


def group_degraded(target: Target, base: Baseline) -> bool:
    group = target.group()
    return group is None or group.status != GroupStatus.READY or group.num_recoveries > base.recoveries


def group_recovered(target: Target, base: Baseline) -> bool:
    group = target.group()
    return (group is not None and group.status == GroupStatus.READY
            and group.num_recoveries > base.recoveries)


def router_sees_no_group(target: Target, base: Baseline) -> bool:
    return not target.router_serving()


def new_scheduler_serving(target: Target, base: Baseline) -> bool:
    group = target.group()
    return (group is not None and group.instance != base.scheduler_instance
            and group.status == GroupStatus.READY and target.router_serving())


def victim_gone(target: Target, base: Baseline) -> bool:
    return not alive(base.victim_pid)


def new_router_serving(target: Target, base: Baseline) -> bool:
    router = next(iter(target.entries("router").values()), None)
    return router is not None and router.instance != base.router_instance and target.router_serving()


def redis_back(target: Target, base: Baseline) -> bool:
    run_id = target.redis_run_id()
    return run_id is not None and run_id != base.redis_run_id


def everyone_registered(target: Target, base: Baseline) -> bool:
    return (redis_back(target, base) and target.group() is not None
            and bool(target.entries("router")) and bool(target.entries("worker")))


def never(target: Target, base: Baseline) -> bool:
    return False


# --- the faults ---------------------------------------------------------------------------


def kill_member(tp_rank: int = 0, pp_rank: int = 0, signum: int = signal.SIGKILL
                ) -> Callable[[Target, Baseline], Action]:
    def prepare(target: Target, base: Baseline) -> Action:
        base.victim_pid = target.member_pid(tp_rank, pp_rank)
        return _signal(base.victim_pid, signum)
    return prepare


def signal_kind(kind: str, signum: int) -> Callable[[Target, Baseline], Action]:
    def prepare(target: Target, base: Baseline) -> Action:
        base.victim_pid = target.pid(kind)
        return _signal(base.victim_pid, signum)
    return prepare


def kill_embedded_valkey(target: Target, base: Baseline) -> Action:
    pid = target.valkey_pid()
    assert pid is not None, "no embedded Valkey found among pagemesh up's children"
    base.victim_pid = pid
    return _signal(pid, signal.SIGKILL)


def kill_external_redis(target: Target, base: Baseline) -> Action:
    """SIGKILL the external Valkey, and start it again (empty) a second later, as its own
    supervisor would."""
    assert target.valkey is not None
    valkey = target.valkey

    def action() -> None:
        os.kill(valkey.pid, signal.SIGKILL)
        time.sleep(1.0)
        valkey.start()
    return action


def partition_worker(target: Target, base: Baseline) -> Action:
    base.victim_pid = target.processes["w1"].pid
    return target.hosts["w1"].partition


def heal_and_see_it_leave(target: Target, base: Baseline) -> None:
    """Back on the network, the cut-off worker finds itself fenced and exits."""
    target.hosts["w1"].heal()
    deadline = time.monotonic() + 30
    while target.processes["w1"].poll() is None:
        assert time.monotonic() < deadline, "the partitioned worker did not leave once fenced"
        time.sleep(0.2)


LONG_PROMPTS = 4  # at once: one 7k prompt stayed under the old 0.3 s bound on a 2-core Xeon


def long_prefill(target: Target, base: Baseline) -> Action:
    """Four 7,000-token prompts at once, prefilled in one step (no chunking, a token budget
    that holds them all): a step far longer than the watchdog's bound, on healthy workers.
    Returns when they are done."""
    from bench.faults.workload import Clients, RequestSpec

    def action() -> None:
        specs = [[RequestSpec(f"long-prefill-{n}", [(i * 7 + n) % 499 + 1 for i in range(7000)],
                              4, None)] for n in range(LONG_PROMPTS)]
        clients = Clients(target.address)
        try:
            results = clients.run(specs).results
        finally:
            clients.close()
        for result in results:
            assert result.error is None and len(result.token_ids) == 4, result.error
    return action


def no_alarm(target: Target, base: Baseline) -> None:
    """No recovery, and the long step was probed (its workers answered)."""
    deadline = time.monotonic() + 5  # the counters reach the registry with a heartbeat
    while True:
        group = target.group()
        assert group is not None and group.num_recoveries == base.recoveries, \
            "the watchdog declared a healthy long step hung"
        if group.num_slow_steps > base.slow_steps:
            return
        assert time.monotonic() < deadline, "no step ran past the watchdog's bound"
        time.sleep(0.2)


SCENARIOS = [
    Scenario("worker kill -9", "single", kill_member(), group_degraded, group_recovered,
             notes="restarted by `pagemesh up`, reloads"),
    Scenario("worker frozen (SIGSTOP)", "single", kill_member(signum=signal.SIGSTOP),
             group_degraded, group_recovered,
             notes="fenced; killed by the liveness probe, restarted"),
    Scenario("scheduler kill -9", "single", signal_kind("scheduler", signal.SIGKILL),
             router_sees_no_group, new_scheduler_serving),
    Scenario("scheduler frozen (SIGSTOP)", "single", signal_kind("scheduler", signal.SIGSTOP),
             router_sees_no_group, new_scheduler_serving,
             notes="keepalive breaks the router's stream; liveness kills it"),
    Scenario("scheduler SIGTERM (drain)", "single", signal_kind("scheduler", signal.SIGTERM),
             router_sees_no_group, new_scheduler_serving),
    Scenario("router kill -9", "single", signal_kind("router", signal.SIGKILL), victim_gone,
             new_router_serving, notes="clients resume by request id"),
    Scenario("router frozen (SIGSTOP)", "single", signal_kind("router", signal.SIGSTOP),
             victim_gone, new_router_serving,
             notes="clients' keepalive, then resume; liveness kills it"),
    Scenario("embedded Valkey kill -9", "single", kill_embedded_valkey, redis_back,
             everyone_registered, notes="restarted by `pagemesh up`; checkpoints rewritten"),
    Scenario("tp rank kill -9", "parallel", kill_member(tp_rank=1), group_degraded,
             group_recovered, notes="the standby takes the rank"),
    Scenario("pp stage kill -9", "parallel", kill_member(tp_rank=0, pp_rank=1), group_degraded,
             group_recovered),
    Scenario("tp rank frozen (SIGSTOP)", "parallel", kill_member(tp_rank=1, signum=signal.SIGSTOP),
             group_degraded, group_recovered, notes="fenced; the standby takes the rank"),
    Scenario("external Redis kill -9", "parallel", kill_external_redis, redis_back,
             everyone_registered, notes="restarted empty after 1 s"),
    Scenario("expert-parallel rank kill -9", "moe-ep", kill_member(tp_rank=1), group_degraded,
             group_recovered, notes="its experts die with it; the standby loads the contiguous placement and "
             "the survivor returns to it"),
    Scenario("worker cut off (netns)", "partition", partition_worker, group_degraded,
             group_recovered, after=heal_and_see_it_leave,
             notes="the standby takes the rank; healed, the worker finds its fence and exits"),
    Scenario("worker kill -9 (image requests)", "llava", kill_member(), group_degraded,
             group_recovered, notes="the restarted worker encodes the images again"),
    Scenario("scheduler kill -9 (image requests)", "llava", signal_kind("scheduler", signal.SIGKILL),
             router_sees_no_group, new_scheduler_serving,
             notes="the router resubmits with the images it holds"),
    Scenario("router kill -9 (image requests)", "llava", signal_kind("router", signal.SIGKILL),
             victim_gone, new_router_serving,
             notes="the new router reads the images from the checkpoints' image store"),
    Scenario("worker kill -9 (LoRA requests)", "lora", kill_member(), group_degraded,
             group_recovered, notes="the restarted worker reads each request's adapter again"),
    Scenario("scheduler kill -9 (LoRA requests)", "lora", signal_kind("scheduler", signal.SIGKILL),
             router_sees_no_group, new_scheduler_serving,
             notes="the restarted scheduler loads the run-time adapter again from the "
             "cluster's table"),
    Scenario("router kill -9 (LoRA requests)", "lora", signal_kind("router", signal.SIGKILL),
             victim_gone, new_router_serving,
             notes="the new router resumes each request, adapter included, from its checkpoint"),
    Scenario("worker kill -9 (speculative decoding)", "spec", kill_member(), group_degraded,
             group_recovered, notes="drafts in flight are dropped; the kept tokens are recomputed"),
    Scenario("router kill -9 (speculative decoding)", "spec", signal_kind("router", signal.SIGKILL),
             victim_gone, new_router_serving,
             notes="clients resume after the tokens kept (never after a draft)"),
    Scenario("long healthy step (4 x 7k-token prefill)", "prefill", long_prefill, never, never,
             after=no_alarm, no_fault=True, notes="watchdog bound 0.05 s: probed, not failed"),
]
