"""The faults around KV moving between groups (disaggregated serving, drains, the host tier):
a group killed or drained once its requests' KV has moved there (`busy_group` aims at it),
a worker killed with its host tier deleted or damaged, and the checks run after the streams
that count, from the schedulers' counters, what was imported, reloaded or recomputed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import grpc

from bench.faults.baseline import Action, Baseline
from bench.faults.process_faults import heal_and_see_it_leave
from bench.faults.targets import HOST_TIER_DIR, Target
from bench.faults.tier_file import damage_sealed_slots, tier_epoch
from pagemesh.runtime.host_tier_files import remove_tier_files, tier_path
from pagemesh.runtime.registry_entries import SchedulerEntry
from pagemesh.tools.admin import AdminClient

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
