"""The fault matrix's scenarios: what is done to a running mesh, and when the mesh has
noticed (detected) and got over it (recovered), judged from outside as an operator would:
the registry, the router's health, the processes.

Each fault is prepared before the streams start (`prepare` picks its victim while the mesh
is calm) and returns the action the runner takes mid-stream; a fault whose victim depends on
the moment (a group running requests) is `aim`ed just before it strikes. The watcher then
polls `detected` and `recovered` against the state `baseline` recorded before the fault.

This module holds `Scenario` and the table of them (`SCENARIOS`); their parts live beside it:
the `Baseline` (baseline.py), the conditions watched (conditions.py), the faults done to
processes (process_faults.py) and those around KV moving between groups (kv_faults.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.faults.baseline import Action, Baseline
from bench.faults.conditions import (
    everyone_registered,
    group_degraded,
    group_draining,
    group_recovered,
    handed_over,
    never,
    new_router_serving,
    new_scheduler_serving,
    redis_back,
    router_sees_no_group,
    victim_gone,
)
from bench.faults.kv_faults import (
    busy_group,
    drain_aimed,
    heal_and_note_imports,
    kill_aimed,
    kill_and_damage_tier,
    kill_and_lose_tier,
    note_imports,
    tier_reloaded,
    tier_replaced,
    tier_slots_refused,
    undo_drain_and_check,
)
from bench.faults.process_faults import (
    heal_and_see_it_leave,
    kill_embedded_valkey,
    kill_external_redis,
    kill_member,
    long_prefill,
    no_alarm,
    partition_host,
    partition_worker,
    signal_kind,
)
from bench.faults.targets import Target


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
