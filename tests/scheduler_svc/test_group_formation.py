"""Choosing an engine group's members from the registry (pure part of group formation)."""

from __future__ import annotations

from pagemesh.runtime.registry_entries import WorkerEntry, WorkerStatus
from scheduler_svc.group_formation import choose_members


def entry(
    group: str = "g0",
    tp: int = 0,
    pp: int = 0,
    tp_size: int = 2,
    pp_size: int = 2,
    status: WorkerStatus = WorkerStatus.JOINING,
) -> WorkerEntry:
    return WorkerEntry(
        group=group,
        tp_rank=tp,
        pp_rank=pp,
        tp_size=tp_size,
        pp_size=pp_size,
        status=status,
        address="x:1",
        dist_addr="x:2",
    )


def test_every_slot_filled_once_deterministically() -> None:
    entries = {f"w{pp}{tp}": entry(tp=tp, pp=pp) for pp in range(2) for tp in range(2)}
    entries["a-spare"] = entry(tp=1, pp=0)  # a standby for slot (0, 1): smallest id wins
    members = choose_members(entries, "g0", 2, 2)
    assert members == {(0, 0): "w00", (0, 1): "a-spare", (1, 0): "w10", (1, 1): "w11"}


def test_missing_slot_other_group_or_layout_means_not_yet() -> None:
    entries = {f"w{tp}": entry(tp=tp, pp=0) for tp in range(2)}
    entries["other"] = entry(group="g1", pp=1)
    entries["wrong-layout"] = entry(pp=1, tp_size=1)
    assert choose_members(entries, "g0", 2, 2) is None
    assert choose_members(
        {"w": entry(tp_size=1, pp_size=1, status=WorkerStatus.READY)}, "g0", 1, 1
    ) == {(0, 0): "w"}


def test_standbys_fill_empty_slots_only_when_allowed() -> None:
    entries = {
        "w0": entry(tp=0, tp_size=2, pp_size=1, status=WorkerStatus.READY),
        "s1": entry(tp=-1, pp=-1, tp_size=2, pp_size=1, status=WorkerStatus.STANDBY),
    }
    # At a first formation a standby must not take the rank of a worker still starting.
    assert choose_members(entries, "g0", 2, 1, use_standby=False) is None
    assert choose_members(entries, "g0", 2, 1) == {(0, 0): "w0", (0, 1): "s1"}
