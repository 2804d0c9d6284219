"""Registry entries (pagemesh/runtime/registry_entries.py): what each service publishes survives the
trip through JSON, a newer writer's extra keys are ignored, an older one's missing keys take
the defaults, and the writers' sources of fields agree with the entries."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagemesh.runtime.registry_entries import (
    GroupStatus,
    RouterEntry,
    SchedulerEntry,
    ServiceEntry,
    WorkerEntry,
    WorkerStatus,
    entry_from_json,
)

WORKER = WorkerEntry(
    address="10.0.0.2:7001",
    instance="i-w1",
    pid=42,
    host="h2",
    metrics_address="10.0.0.2:9102",
    group="g0",
    model="tiny",
    dist_addr="10.0.0.2:29500",
    tp_rank=1,
    tp_size=2,
    pp_rank=0,
    pp_size=1,
    status=WorkerStatus.READY,
    epoch="e1",
    num_reforms=2,
    quantization="awq",
    weight_bytes=1000,
    num_steps=500,
    busy_time_s=10.5,
    tp_collective_time_s=0.25,
    pp_send_time_s=0.0,
    pp_recv_time_s=0.0,
)
SCHEDULER = SchedulerEntry(
    address="10.0.0.1:6001",
    instance="i-s1",
    pid=41,
    host="h1",
    metrics_address=None,
    group="g0",
    model="tiny",
    status=GroupStatus.DEGRADED,
    members=("w0", "w1"),
    num_recoveries=1,
    num_steps=500,
    checkpoint_writes=7,
    checkpoint_write_s=0.125,
    num_running=3,
    num_waiting=2,
    num_free_blocks=25,
    num_blocks=100,
    num_preemptions=4,
    num_swapped=1,
    num_free_swap_blocks=8,
    num_cached_blocks=10,
    prefix_cache_queries=64,
    prefix_cache_hits=32,
    prefix_cache_hit_rate=0.5,
)
ROUTER = RouterEntry(
    address="10.0.0.3:50051",
    instance="i-r1",
    pid=43,
    host="h3",
    metrics_address="10.0.0.3:9100",
    serving=True,
    num_groups=1,
)


ENTRIES = pytest.mark.parametrize("entry", [WORKER, SCHEDULER, ROUTER], ids=lambda e: e.KIND)


@ENTRIES
def test_an_entry_survives_json(entry: ServiceEntry) -> None:
    published = json.loads(json.dumps(entry.to_json()))
    assert type(entry).from_json(published) == entry
    assert entry_from_json(entry.KIND, published) == entry
    # Statuses travel as their plain strings, readable in Redis.
    if isinstance(entry, (WorkerEntry, SchedulerEntry)):
        assert published["status"] == entry.status.value
    assert "metrics_address" in published or entry.metrics_address is None  # None left out


@ENTRIES
def test_keys_from_a_newer_writer_are_ignored(entry: ServiceEntry) -> None:
    published = {**entry.to_json(), "gpu_temperature_c": 71, "labels": {"zone": "a"}}
    assert type(entry).from_json(published) == entry


def test_keys_an_older_writer_left_out_take_the_defaults() -> None:
    worker = WorkerEntry.from_json({"address": "x:1", "group": "g0"})
    assert (worker.address, worker.group) == ("x:1", "g0")
    assert (worker.tp_rank, worker.tp_size, worker.pp_rank, worker.pp_size) == (0, 1, 0, 1)
    assert worker.status is WorkerStatus.JOINING and worker.epoch == ""
    assert worker.quantization is None and worker.busy_time_s == 0.0 and worker.instance == ""
    # A scheduler from before statuses existed was ready whenever registered.
    scheduler = SchedulerEntry.from_json({"address": "x:2", "status": None})
    assert scheduler.status is GroupStatus.READY and scheduler.members == ()
    assert scheduler.num_free_blocks is None and scheduler.kv_cache_usage() is None
    assert SchedulerEntry(num_blocks=100, num_free_blocks=25).kv_cache_usage() == 0.75
    router = RouterEntry.from_json({})
    assert (router.address, router.serving, router.num_groups, router.pid) == ("", False, 0, -1)


@pytest.mark.parametrize(
    "entry_type, raw",
    [
        (SchedulerEntry, {"status": "paused"}),  # a status this version does not know
        (WorkerEntry, {"status": "ready-ish"}),
        (SchedulerEntry, {"num_steps": "many"}),
        (SchedulerEntry, {"members": "w0"}),  # a list is expected, not a string
        (RouterEntry, {"serving": "yes"}),
        (RouterEntry, ["not", "an", "object"]),
    ],
)
def test_a_malformed_entry_is_refused(entry_type: type[ServiceEntry], raw: object) -> None:
    with pytest.raises(ValueError):
        entry_type.from_json(raw)  # type: ignore[arg-type]


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown service kind"):
        entry_from_json("gateway", {})


def test_statuses_compare_equal_to_their_strings() -> None:
    assert GroupStatus.READY == "ready" and WorkerStatus.STANDBY == "standby"
    assert json.dumps({"status": GroupStatus.DRAINING}) == '{"status": "draining"}'


def test_the_scheduler_core_stats_are_scheduler_entry_fields() -> None:
    # scheduler_svc/main.py spreads SchedulerStats into its entry: a stats field the entry
    # lacks would fail every heartbeat.
    from scheduler_svc.core.config import SchedulerStats

    entry_fields = {f.name for f in dataclasses.fields(SchedulerEntry)}
    assert {f.name for f in dataclasses.fields(SchedulerStats)} <= entry_fields


def test_the_worker_state_is_worker_entry_fields() -> None:
    # worker_svc/main.py spreads the membership state into its entry, as above.
    from worker_svc.membership import WorkerState

    entry_fields = {f.name for f in dataclasses.fields(WorkerEntry)}
    assert {f.name for f in dataclasses.fields(WorkerState)} <= entry_fields


def test_every_group_status_has_its_proto_value() -> None:
    from protos.pagemesh.scheduler.v1 import scheduler_pb2
    from scheduler_svc.convert import GROUP_STATUS_TO_PB

    assert set(GROUP_STATUS_TO_PB) == set(GroupStatus)
    names = {scheduler_pb2.GroupStatus.Name(value) for value in GROUP_STATUS_TO_PB.values()}
    assert names == {f"GROUP_STATUS_{status.name}" for status in GroupStatus}
    assert set(scheduler_pb2.GroupStatus.keys()) == names | {"GROUP_STATUS_UNSPECIFIED"}
