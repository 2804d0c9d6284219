"""What the engine group is: each worker's `GetWorkerInfo` reply read into a `WorkerInfo`,
and the group's answers to the router written from it: the model info (`generate.proto`)
and the scheduler's stats and status (`scheduler.proto`)."""

from __future__ import annotations

from pagemesh.runtime.registry_entries import GroupStatus
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from protos.pagemesh.worker.v1 import worker_pb2
from protos.pooling import (
    image_tiling_from_pb,
    image_tiling_to_pb,
    pooling_info_from_pb,
    pooling_info_to_pb,
)
from scheduler_svc.convert.kv import kv_rank_from_pb
from scheduler_svc.core.scheduler import SchedulerStats
from scheduler_svc.messages import WorkerInfo


def worker_info_request_pb() -> worker_pb2.GetWorkerInfoRequest:
    return worker_pb2.GetWorkerInfoRequest()


def worker_info_from_pb(pb: worker_pb2.GetWorkerInfoResponse) -> WorkerInfo:
    return WorkerInfo(
        worker_id=pb.worker_id,
        model=pb.model,
        architecture=pb.architecture,
        vocab_size=pb.vocab_size,
        eos_token_ids=tuple(pb.eos_token_ids),
        max_model_len=pb.max_model_len,
        dtype=pb.dtype,
        num_blocks=pb.num_blocks,
        block_size=pb.block_size,
        tp_rank=pb.tp_rank,
        tp_size=pb.tp_size,
        pp_rank=pb.pp_rank,
        pp_size=pb.pp_size,
        num_swap_blocks=pb.num_swap_blocks,
        quantization=pb.quantization,
        weight_bytes=pb.weight_bytes,
        kv_cache_bytes=pb.kv_cache_bytes,
        kv_cache_sizing=pb.kv_cache_sizing,
        pooling=pooling_info_from_pb(pb.pooling),
        image_token_id=pb.image_token_id,
        image_seq_length=pb.image_seq_length,
        image_tiling=image_tiling_from_pb(pb.image_tiling),
        kv_rank=kv_rank_from_pb(pb.kv_transfer) if pb.kv_transfer.address else None,
        host_tier_slots=pb.host_tier_slots,
        host_tier_epoch=pb.host_tier_epoch,
    )


def model_info_to_pb(
    info: WorkerInfo,
    num_blocks: int,
    weight_bytes: int | None = None,
    kv_cache_bytes: int | None = None,
) -> generate_pb2.GetModelInfoResponse:
    """`info`: the group driver's; `weight_bytes`, `kv_cache_bytes`: the group's totals over
    its ranks (None = the driver's own, for a group of one)."""
    return generate_pb2.GetModelInfoResponse(
        model=info.model,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        dtype=info.dtype,
        architecture=info.architecture,
        block_size=info.block_size,
        num_kv_blocks=num_blocks,
        quantization=info.quantization,
        weight_bytes=info.weight_bytes if weight_bytes is None else weight_bytes,
        kv_cache_bytes=info.kv_cache_bytes if kv_cache_bytes is None else kv_cache_bytes,
        kv_cache_sizing=info.kv_cache_sizing,
        pooling=pooling_info_to_pb(info.pooling),
        image_token_id=info.image_token_id,
        image_seq_length=info.image_seq_length,
        image_tiling=image_tiling_to_pb(info.image_tiling),
        layout=generate_pb2.ParallelLayout(
            tensor_parallel_size=info.tp_size,
            pipeline_parallel_size=info.pp_size,
            num_replicas=1,
        ),
    )


GROUP_STATUS_TO_PB = {
    GroupStatus.READY: scheduler_pb2.GROUP_STATUS_READY,
    GroupStatus.DEGRADED: scheduler_pb2.GROUP_STATUS_DEGRADED,
    GroupStatus.DRAINING: scheduler_pb2.GROUP_STATUS_DRAINING,
}


def stats_to_pb(
    stats: SchedulerStats,
    num_steps: int,
    status: GroupStatus = GroupStatus.READY,
    num_recoveries: int = 0,
) -> scheduler_pb2.GetStatsResponse:
    return scheduler_pb2.GetStatsResponse(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_blocks=stats.num_free_blocks,
        num_blocks=stats.num_blocks,
        num_preemptions=stats.num_preemptions,
        num_swap_outs=stats.num_swap_outs,
        num_swap_ins=stats.num_swap_ins,
        num_steps=num_steps,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        num_cached_blocks=stats.num_cached_blocks,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_draft_tokens=stats.num_draft_tokens,
        num_drafts=stats.num_drafts,
        num_accepted_tokens=stats.num_accepted_tokens,
        group_status=GROUP_STATUS_TO_PB[status],
        num_recoveries=num_recoveries,
    )
