"""The admin calls (pagemesh.v1.Admin, `admin.proto`) that the scheduler forwards to its
workers: the requests it sends them (memory, step stats, profiles, LoRA adapters), and its
replies, the workers' reports with the group's figures filled in (KV block occupancy, steps,
prefix cache resets, the adapters held)."""

from __future__ import annotations

from collections.abc import Sequence

from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import admin_pb2
from protos.pagemesh.worker.v1 import worker_pb2
from scheduler_svc.core.scheduler import SchedulerStats

# The workers' reports pass through the scheduler as the very messages they sent (the
# router's Admin service returns the same types), with the group's figures filled in.
RankMemoryReport = admin_pb2.RankMemory
RankStepStatsReport = admin_pb2.RankStepStats
ProfileTraceReport = admin_pb2.ProfileTrace


def memory_request_pb() -> worker_pb2.GetMemoryRequest:
    return worker_pb2.GetMemoryRequest()


def step_stats_request_pb(window_s: float) -> worker_pb2.GetStepStatsRequest:
    return worker_pb2.GetStepStatsRequest(window_s=window_s)


def start_profile_request_pb(
    out_dir: str, trace_name: str, record_shapes: bool, with_stack: bool
) -> worker_pb2.StartProfileRequest:
    return worker_pb2.StartProfileRequest(
        out_dir=out_dir, trace_name=trace_name, record_shapes=record_shapes, with_stack=with_stack
    )


def stop_profile_request_pb() -> worker_pb2.StopProfileRequest:
    return worker_pb2.StopProfileRequest()


def prefix_cache_reset_to_pb(
    group: str, scheduler_id: str, num_dropped: int, stats: SchedulerStats
) -> scheduler_pb2.ResetPrefixCacheResponse:
    """After a reset every block still cached is held by a running request."""
    return scheduler_pb2.ResetPrefixCacheResponse(
        group=admin_pb2.GroupPrefixCacheReset(
            group=group,
            scheduler_id=scheduler_id,
            num_blocks_dropped=num_dropped,
            num_blocks_kept_in_use=stats.num_cached_blocks,
        )
    )


def group_memory_to_pb(
    group: str,
    scheduler_id: str,
    stats: SchedulerStats,
    num_swap_blocks: int,
    ranks: list[RankMemoryReport],
) -> scheduler_pb2.GetMemoryResponse:
    """The workers' memory with the group's block occupancy (the core's) on every rank:
    the block ids the core hands out are the same on each rank."""
    num_used = stats.num_blocks - stats.num_free_blocks
    num_used_swap = num_swap_blocks - stats.num_free_swap_blocks
    for rank in ranks:  # the workers' replies, this call's own: filled in place
        rank.num_kv_blocks = stats.num_blocks
        rank.num_used_kv_blocks = num_used
        rank.num_free_kv_blocks = stats.num_free_blocks
        rank.kv_cache_used_bytes = num_used * rank.kv_bytes_per_block
        rank.num_used_swap_blocks = num_used_swap
    return scheduler_pb2.GetMemoryResponse(
        group=admin_pb2.GroupMemory(
            group=group,
            scheduler_id=scheduler_id,
            num_running=stats.num_running,
            num_cached_blocks=stats.num_cached_blocks,
            ranks=ranks,
        )
    )


def group_step_stats_to_pb(
    group: str, scheduler_id: str, num_steps: int, ranks: list[RankStepStatsReport]
) -> scheduler_pb2.GetStepStatsResponse:
    return scheduler_pb2.GetStepStatsResponse(
        group=admin_pb2.GroupStepStats(
            group=group, scheduler_id=scheduler_id, num_steps=num_steps, ranks=ranks
        )
    )


def group_profile(
    group: str, scheduler_id: str, traces: list[ProfileTraceReport], refusals: list[str]
) -> admin_pb2.GroupProfile:
    return admin_pb2.GroupProfile(
        group=group, scheduler_id=scheduler_id, traces=traces, error="; ".join(refusals)
    )


def lora_load_request_pb(name: str, path: str) -> admin_pb2.LoadLoraAdapterRequest:
    return admin_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)


def lora_unload_request_pb(name: str) -> admin_pb2.UnloadLoraAdapterRequest:
    return admin_pb2.UnloadLoraAdapterRequest(lora_name=name)


def lora_loaded_pb(
    group: str, version: int, held: Sequence[str]
) -> admin_pb2.LoadLoraAdapterResponse:
    return admin_pb2.LoadLoraAdapterResponse(groups=[group], lora_version=version, loras=held)


def lora_unloaded_pb(
    group: str, version: int, held: Sequence[str]
) -> admin_pb2.UnloadLoraAdapterResponse:
    return admin_pb2.UnloadLoraAdapterResponse(groups=[group], lora_version=version, loras=held)
