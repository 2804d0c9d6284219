"""The fault matrix's scenarios: what is done to a running mesh, and when the mesh has
noticed (detected) and got over it (recovered), judged from outside as an operator would:
the registry, the router's health, the processes.

Each fault is prepared before the streams start (`prepare` picks its victim while the mesh
is calm) and returns the action the runner takes mid-stream; a fault whose victim depends on
the moment (a group running requests) is `aim`ed just before it strikes. The watcher then
polls `detected` and `recovered` against the state `baseline` recorded before the fault.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from bench.faults.targets import HOST_TIER_DIR, Target
from bench.faults.tier_file import damage_sealed_slots, tier_epoch
from pagemesh.runtime.host_tier_files import remove_tier_files, tier_path
from pagemesh.runtime.registry_entries import GroupStatus, SchedulerEntry
from pagemesh.tools.admin import AdminClient
from pagemesh.tools.mesh_process import alive

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
    # Strike once half the clients have their first token (the prefill group is handing
    # its first batch over: KV moves), not a quarter of the way into the workload.
    strike_early: bool = False
    # Called as the fault is due, before its clock starts: picks a victim by the moment.
    aim: Callable[[Target, Baseline], None] | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)


def _signal(pid: int, signum: int) -> Action:
    return lambda: os.kill(pid, signum)


# --- what is noticed, and when it is over -----------------------------------------------


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


# --- the faults ---------------------------------------------------------------------------


def kill_member(
    tp_rank: int = 0, pp_rank: int = 0, signum: int = signal.SIGKILL, group: str | None = None
) -> Callable[[Target, Baseline], Action]:
    """Signals the member at (pp_rank, tp_rank) of `group` (default: the target's first)."""

    def prepare(target: Target, base: Baseline) -> Action:
        if group is not None:
            base.watch(group, target.group(group))
        base.victim_pid = target.member_pid(tp_rank, pp_rank, base.group)
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


def partition_host(role: str) -> Callable[[Target, Baseline], Action]:
    """Cuts the host of the process `role` off the network (a netns target's)."""

    def prepare(target: Target, base: Baseline) -> Action:
        base.victim_pid, base.victim_host = target.processes[role].pid, role
        return target.hosts[role].partition

    return prepare


partition_worker = partition_host("w1")


def heal_and_see_it_leave(target: Target, base: Baseline) -> None:
    """Back on the network, the cut-off worker finds itself fenced and exits."""
    target.hosts[base.victim_host].heal()
    deadline = time.monotonic() + 30
    while target.processes[base.victim_host].poll() is None:
        assert time.monotonic() < deadline, "the partitioned worker did not leave once fenced"
        time.sleep(0.2)


LONG_PROMPTS = 4  # at once: one 7k prompt stayed under the old 0.3 s bound on a 2-core Xeon


def long_prefill(target: Target, base: Baseline) -> Action:
    """Four 7,000-token prompts at once, prefilled in one step (no chunking, a token budget
    that holds them all): a step far longer than the watchdog's bound, on healthy workers.
    Returns when they are done."""
    from bench.faults.workload import Clients, RequestSpec

    def action() -> None:
        specs = [
            [
                RequestSpec(
                    f"long-prefill-{n}", [(i * 7 + n) % 499 + 1 for i in range(7000)], 4, None
                )
            ]
            for n in range(LONG_PROMPTS)
        ]
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
        assert group is not None and group.num_recoveries == base.recoveries, (
            "the watchdog declared a healthy long step hung"
        )
        if group.num_slow_steps > base.slow_steps:
            return
        assert time.monotonic() < deadline, "no step ran past the watchdog's bound"
        time.sleep(0.2)


# --- KV moving between groups: disaggregated serving, drains, the host tier -------------

HEARTBEAT_WAIT_S = 2.5  # the counters reach the registry with a heartbeat (about 1 s)


def _after_a_heartbeat(target: Target) -> dict[str, SchedulerEntry]:
    time.sleep(HEARTBEAT_WAIT_S)
    return target.groups_now()


def _grown(
    groups: dict[str, SchedulerEntry], base: Baseline, counter: str, role: str | None = None
) -> int:
    """How much `counter` grew since the fault, summed over the groups (of `role`)."""
    return sum(
        getattr(entry, counter) - getattr(base.schedulers[name], counter)
        for name, entry in groups.items()
        if name in base.schedulers and role in (None, entry.role)
    )


def note_imports(target: Target, base: Baseline) -> None:
    """Notes how many of the decode groups' imports of KV failed (and recomputed)."""
    groups = _after_a_heartbeat(target)
    base.notes.append(
        f"decode imports failed {_grown(groups, base, 'kv_imports_failed', 'decode')}"
        f" of {_grown(groups, base, 'kv_imports', 'decode')}; "
        f"{_grown(groups, base, 'num_recomputed_tokens')} tokens recomputed"
    )


def _tier_path(target: Target, base: Baseline) -> str:
    """The host tier file of the victim's rank (the first of its group)."""
    return tier_path(HOST_TIER_DIR, target.cluster, base.group, pp_rank=0, tp_rank=0)


def kill_and_lose_tier(target: Target, base: Baseline) -> Action:
    """SIGKILL of the worker, and its host tier deleted before its successor opens it."""
    base.victim_pid = target.member_pid()
    base.tier_epoch = tier_epoch(_tier_path(target, base))

    def action() -> None:
        os.kill(base.victim_pid, signal.SIGKILL)
        assert remove_tier_files(HOST_TIER_DIR, target.cluster), "no host tier file to delete"

    return action


def kill_and_damage_tier(target: Target, base: Baseline) -> Action:
    """SIGKILL of the worker, then random bytes written over the data of every slot of its
    host tier that holds a block, before its successor opens it."""
    base.victim_pid = target.member_pid()

    def action() -> None:
        os.kill(base.victim_pid, signal.SIGKILL)
        num_slots = damage_sealed_slots(_tier_path(target, base))
        base.notes.append(f"{num_slots} slots damaged")

    return action


def tier_reloaded(target: Target, base: Baseline) -> None:
    """The requests carried over reloaded their blocks from the host tier: its loads grew.
    With more than one request per client, loads of requests sent before the kill count
    too; the tokens recomputed tell how much the carried ones were spared."""
    groups = _after_a_heartbeat(target)
    loads = _grown(groups, base, "kv_tier_loads")
    base.notes.append(
        f"{loads} tier loads, {_grown(groups, base, 'num_recomputed_tokens')} tokens recomputed"
    )
    if loads == 0 and _grown(groups, base, "num_recomputed_tokens") == 0:
        base.notes.append("no request was carried over (every one had ended)")
        return
    assert loads > 0, "no request reloaded its blocks from the host tier"


def tier_replaced(target: Target, base: Baseline) -> None:
    """The restarted worker made a new tier (a new epoch) and the requests carried over
    recomputed. Loads are only noted: with more than one request per client, requests
    sent before the kill load blocks of earlier runs from the old tier, and those after
    the restart may find blocks written to the new one since."""
    groups = _after_a_heartbeat(target)
    recomputed = _grown(groups, base, "num_recomputed_tokens")
    base.notes.append(
        f"{recomputed} tokens recomputed; {_grown(groups, base, 'kv_tier_loads')} "
        f"tier loads, {_grown(groups, base, 'kv_imports_failed')} failed"
    )
    assert tier_epoch(_tier_path(target, base)) != base.tier_epoch, (
        "the restarted worker did not make a new host tier"
    )
    if recomputed == 0 and _grown(groups, base, "kv_tier_loads") == 0:
        base.notes.append("no request was carried over (every one had ended)")
        return
    assert recomputed > 0, "no request recomputed its KV"


def tier_slots_refused(target: Target, base: Baseline) -> None:
    """The damaged slots failed their checks: those imports failed, the requests recomputed."""
    groups = _after_a_heartbeat(target)
    failed, recomputed = (
        _grown(groups, base, "kv_imports_failed"),
        _grown(groups, base, "num_recomputed_tokens"),
    )
    loads = _grown(groups, base, "kv_tier_loads")
    base.notes.append(f"{failed} tier imports failed, {recomputed} tokens recomputed")
    if failed == 0 and loads == 0:  # every request had ended (the small test's workload)
        base.notes.append("no request was carried over to reload from the damaged tier")
        return
    assert failed > 0, "no load from the damaged tier failed its checks"


PLATEAU_POLLS = 3  # polls (some 10 ms apart) over which a group's running count holds


def busy_group(role: str, timeout_s: float = 30.0) -> Callable[[Target, Baseline], None]:
    """Aims at the `role` group running the most requests once the KV of its requests has
    moved there, as near as the schedulers' figures tell: over PLATEAU_POLLS polls it was
    the busiest, queued nothing, and ran no more requests (an import that ends queues its
    request, then runs it). Imports in flight are in neither figure, so a few requests may
    still be pulling their KV (`note_imports` counts those that failed)."""

    def aim(target: Target, base: Baseline) -> None:
        roles = {name: entry.role for name, entry in target.groups_now().items()}
        ours = [n for n in target.groups if roles.get(n) == role]
        deadline = time.monotonic() + timeout_s
        seen: list[tuple[str, int]] = []  # the busiest group and its count, per poll
        with target.scheduler_stats(ours) as stats_now:
            while not _settled(seen[-PLATEAU_POLLS:]):
                assert time.monotonic() < deadline, f"no {role} group of {target.name} got busy"
                time.sleep(0.01)
                stats = stats_now()
                name = max(ours, key=lambda n: stats[n].num_running)
                if stats[name].num_running and not stats[name].num_waiting:
                    seen.append((name, stats[name].num_running))
                else:
                    seen.clear()
        base.watch(name, target.group(name))
        base.victim_pid = target.member_pid(group=name)

    return aim


def _settled(seen: list[tuple[str, int]]) -> bool:
    return (
        len(seen) == PLATEAU_POLLS
        and len({name for name, _ in seen}) == 1
        and all(a >= b for (_, a), (_, b) in zip(seen, seen[1:]))
    )


def kill_aimed(target: Target, base: Baseline) -> Action:
    """SIGKILL of the victim `aim` picked."""
    return lambda: os.kill(base.victim_pid, signal.SIGKILL)


def drain_aimed(target: Target, base: Baseline) -> Action:
    """The router's Admin Drain of the group `aim` picked: it admits nothing more and hands
    its running requests over with their KV."""

    def action() -> None:
        with grpc.insecure_channel(target.address) as channel:
            reply = AdminClient(channel).drain(base.group)
        base.drained = (reply.num_migrated, reply.num_recomputed)

    return action


def undo_drain_and_check(target: Target, base: Baseline) -> None:
    """Serves again (the next row starts at rest), then: the drained group's holds were
    pulled, and the other groups of its role recomputed nothing (unless the drain said
    some requests were not running: waiting or importing ones fail there and recompute
    elsewhere). A request whose KV the group continuing it has cached already is not
    pulled: that group's prefix cache serves it."""
    with grpc.insecure_channel(target.address) as channel:
        AdminClient(channel).drain(base.group, undo=True)
    assert base.drained is not None, "the drain never answered"
    migrated, not_running = base.drained
    groups = _after_a_heartbeat(target)
    drained = groups[base.group]
    pulled = drained.kv_holds_pulled - base.schedulers[base.group].kv_holds_pulled
    others = {n: e for n, e in groups.items() if n != base.group and e.role == drained.role}
    recomputed = _grown(others, base, "num_recomputed_tokens")
    base.notes.append(
        f"{migrated} handed over with their KV ({pulled} pulled), {not_running} "
        f"not running; {recomputed} tokens recomputed on {', '.join(others)}"
    )
    if migrated == 0:  # its requests ended before the drain reached it (a loaded machine)
        base.notes.append("nothing was running there when the drain came")
        return
    assert 0 < pulled <= migrated, f"{pulled} of the {migrated} holds were pulled"
    assert not_running or recomputed == 0, (
        f"{recomputed} tokens recomputed after a drain that moved every request with its KV"
    )


def heal_and_note_imports(target: Target, base: Baseline) -> None:
    heal_and_see_it_leave(target, base)
    note_imports(target, base)


SCENARIOS = [
    Scenario(
        "worker kill -9",
        "single",
        kill_member(),
        group_degraded,
        group_recovered,
        notes="restarted by `pagemesh up`, reloads",
    ),
    Scenario(
        "worker frozen (SIGSTOP)",
        "single",
        kill_member(signum=signal.SIGSTOP),
        group_degraded,
        group_recovered,
        notes="fenced; killed by the liveness probe, restarted",
    ),
    Scenario(
        "scheduler kill -9",
        "single",
        signal_kind("scheduler", signal.SIGKILL),
        router_sees_no_group,
        new_scheduler_serving,
    ),
    Scenario(
        "scheduler frozen (SIGSTOP)",
        "single",
        signal_kind("scheduler", signal.SIGSTOP),
        router_sees_no_group,
        new_scheduler_serving,
        notes="keepalive breaks the router's stream; liveness kills it",
    ),
    Scenario(
        "scheduler SIGTERM (drain)",
        "single",
        signal_kind("scheduler", signal.SIGTERM),
        router_sees_no_group,
        new_scheduler_serving,
    ),
    Scenario(
        "router kill -9",
        "single",
        signal_kind("router", signal.SIGKILL),
        victim_gone,
        new_router_serving,
        notes="clients resume by request id",
    ),
    Scenario(
        "router frozen (SIGSTOP)",
        "single",
        signal_kind("router", signal.SIGSTOP),
        victim_gone,
        new_router_serving,
        notes="clients' keepalive, then resume; liveness kills it",
    ),
    Scenario(
        "embedded Valkey kill -9",
        "single",
        kill_embedded_valkey,
        redis_back,
        everyone_registered,
        notes="restarted by `pagemesh up`; checkpoints rewritten",
    ),
    Scenario(
        "tp rank kill -9",
        "parallel",
        kill_member(tp_rank=1),
        group_degraded,
        group_recovered,
        notes="the standby takes the rank",
    ),
    Scenario(
        "pp stage kill -9",
        "parallel",
        kill_member(tp_rank=0, pp_rank=1),
        group_degraded,
        group_recovered,
    ),
    Scenario(
        "tp rank frozen (SIGSTOP)",
        "parallel",
        kill_member(tp_rank=1, signum=signal.SIGSTOP),
        group_degraded,
        group_recovered,
        notes="fenced; the standby takes the rank",
    ),
    Scenario(
        "external Redis kill -9",
        "parallel",
        kill_external_redis,
        redis_back,
        everyone_registered,
        notes="restarted empty after 1 s",
    ),
    Scenario(
        "expert-parallel rank kill -9",
        "moe-ep",
        kill_member(tp_rank=1),
        group_degraded,
        group_recovered,
        notes="its experts die with it; the standby loads the contiguous placement and "
        "the survivor returns to it",
    ),
    Scenario(
        "worker cut off (netns)",
        "partition",
        partition_worker,
        group_degraded,
        group_recovered,
        after=heal_and_see_it_leave,
        notes="the standby takes the rank; healed, the worker finds its fence and exits",
    ),
    Scenario(
        "worker kill -9 (image requests)",
        "llava",
        kill_member(),
        group_degraded,
        group_recovered,
        notes="the restarted worker encodes the images again",
    ),
    Scenario(
        "scheduler kill -9 (image requests)",
        "llava",
        signal_kind("scheduler", signal.SIGKILL),
        router_sees_no_group,
        new_scheduler_serving,
        notes="the router resubmits with the images it holds",
    ),
    Scenario(
        "router kill -9 (image requests)",
        "llava",
        signal_kind("router", signal.SIGKILL),
        victim_gone,
        new_router_serving,
        notes="the new router reads the images from the checkpoints' image store",
    ),
    Scenario(
        "worker kill -9 (LoRA requests)",
        "lora",
        kill_member(),
        group_degraded,
        group_recovered,
        notes="the restarted worker reads each request's adapter again",
    ),
    Scenario(
        "scheduler kill -9 (LoRA requests)",
        "lora",
        signal_kind("scheduler", signal.SIGKILL),
        router_sees_no_group,
        new_scheduler_serving,
        notes="the restarted scheduler loads the run-time adapter again from the cluster's table",
    ),
    Scenario(
        "router kill -9 (LoRA requests)",
        "lora",
        signal_kind("router", signal.SIGKILL),
        victim_gone,
        new_router_serving,
        notes="the new router resumes each request, adapter included, from its checkpoint",
    ),
    Scenario(
        "worker kill -9 (speculative decoding)",
        "spec",
        kill_member(),
        group_degraded,
        group_recovered,
        notes="drafts in flight are dropped; the kept tokens are recomputed",
    ),
    Scenario(
        "router kill -9 (speculative decoding)",
        "spec",
        signal_kind("router", signal.SIGKILL),
        victim_gone,
        new_router_serving,
        notes="clients resume after the tokens kept (never after a draft)",
    ),
    Scenario(
        "long healthy step (4 x 7k-token prefill)",
        "prefill",
        long_prefill,
        never,
        never,
        after=no_alarm,
        no_fault=True,
        notes="watchdog bound 0.05 s: probed, not failed",
    ),
    Scenario(
        "prefill group killed mid-transfer",
        "pd",
        kill_member(group="prefill0"),
        group_degraded,
        group_recovered,
        after=note_imports,
        strike_early=True,
        notes="its holds die with it: the decode groups' pulls of them fail and those "
        "requests recompute; new requests run on the decode groups meanwhile",
    ),
    Scenario(
        "decode group killed after the transfer",
        "pd",
        kill_aimed,
        group_degraded,
        group_recovered,
        after=note_imports,
        strike_early=True,
        aim=busy_group("decode"),
        notes="the busiest decode group once its requests' KV has moved there; "
        "restarted by `pagemesh up`, it recomputes them",
    ),
    Scenario(
        "decode group drained (KV migrated)",
        "pd",
        drain_aimed,
        group_draining,
        handed_over,
        after=undo_drain_and_check,
        strike_early=True,
        aim=busy_group("decode"),
        notes="Admin Drain of the busiest decode group once its requests' KV has moved; "
        "detected: it is draining; recovered: its entry shows it running nothing; "
        "undone after",
    ),
    Scenario(
        "worker kill -9 (host tier)",
        "tier",
        kill_member(),
        group_degraded,
        group_recovered,
        after=tier_reloaded,
        notes="the requests carried over reload their full blocks from the tier",
    ),
    Scenario(
        "host tier lost after a restart",
        "tier",
        kill_and_lose_tier,
        group_degraded,
        group_recovered,
        after=tier_replaced,
        notes="tier file deleted with the kill: a new epoch, the index forgotten",
    ),
    Scenario(
        "host tier corrupted after a restart",
        "tier",
        kill_and_damage_tier,
        group_degraded,
        group_recovered,
        after=tier_slots_refused,
        notes="4 KiB of random bytes in each sealed slot's data: checksums refuse them",
    ),
    Scenario(
        "transfer channel cut (netns)",
        "pd-partition",
        partition_host("pw0"),
        group_degraded,
        group_recovered,
        after=heal_and_note_imports,
        strike_early=True,
        notes="the prefill worker's host cut off: decode pulls time out (2 s) and "
        "recompute; the standby takes the rank; healed, the worker finds its fence",
    ),
]
