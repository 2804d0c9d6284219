"""The only place on the worker that touches protobuf types."""

from __future__ import annotations

from collections.abc import Iterable

from protos.pagemesh.v1 import admin_pb2
from protos.pagemesh.worker.v1 import worker_pb2
from protos.pooling import image_tiling_to_pb, pooling_info_to_pb
from protos.step import (
    CachedRequestData,
    ImageInput,
    LoraRef,
    ModelRunnerOutput,
    NewRequestData,
    PoolingParams,
    SamplingParams,
    SchedulerOutput,
)
from worker_svc.diagnostics import ProfileTraceFile, RankMemory, StepStatsSnapshot
from worker_svc.host_tier import HostTier
from worker_svc.kv_transfer.layout import RankSlice
from worker_svc.kv_transfer.pull import PullResult


def sampling_from_pb(pb: worker_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=pb.temperature,
        top_p=pb.top_p,
        top_k=pb.top_k,
        min_p=pb.min_p,
        repetition_penalty=pb.repetition_penalty,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        seed=pb.seed,
        min_tokens=pb.min_tokens,
        stop_token_ids=tuple(pb.stop_token_ids),
        num_logprobs=pb.num_logprobs,
        grammar=pb.grammar,
    )


def scheduler_output_from_pb(pb: worker_pb2.ExecuteStepRequest) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=pb.step_id,
        new_requests=[
            NewRequestData(
                request_id=r.request_id,
                token_ids=list(r.token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                sampling=sampling_from_pb(r.sampling),
                pooling=(
                    PoolingParams(dimensions=r.pooling.dimensions, image=r.pooling.image)
                    if r.HasField("pooling")
                    else None
                ),
                images=tuple(ImageInput(i.data, i.offset, i.length, i.sha256) for i in r.images),
                lora=LoraRef(r.lora.name, r.lora.path) if r.HasField("lora") else None,
            )
            for r in pb.new_requests
        ],
        cached_requests=[
            CachedRequestData(
                request_id=r.request_id,
                new_block_ids=list(r.new_block_ids),
                num_computed_tokens=r.num_computed_tokens,
                new_token_ids=list(r.new_token_ids),
                spec_token_ids=list(r.spec_token_ids),
            )
            for r in pb.cached_requests
        ],
        num_scheduled_tokens=dict(pb.num_scheduled_tokens),
        finished_request_ids=list(pb.finished_request_ids),
        blocks_to_swap_out=[(p.src, p.dst) for p in pb.blocks_to_swap_out],
        blocks_to_swap_in=[(p.src, p.dst) for p in pb.blocks_to_swap_in],
        blocks_to_copy=[(p.src, p.dst) for p in pb.blocks_to_copy],
        blocks_to_offload=[(t.block, t.slot, t.key) for t in pb.blocks_to_offload],
        append_sampled_tokens=pb.append_sampled_tokens,
    )


def step_trace_from_pb(pb: worker_pb2.ExecuteStepRequest) -> tuple[list[str], int, int]:
    """(`traceparent` of each traced request, cached requests first then new ones in step
    order; requests computed; tokens computed) of one step."""
    traceparents = pb.traceparents
    ordered = [
        traceparents[r.request_id]
        for requests in (pb.cached_requests, pb.new_requests)
        for r in requests
        if r.request_id in traceparents
    ]
    scheduled = pb.num_scheduled_tokens
    return ordered, len(scheduled), sum(scheduled.values())


def model_runner_output_to_pb(output: ModelRunnerOutput) -> worker_pb2.ExecuteStepResponse:
    return worker_pb2.ExecuteStepResponse(
        step_id=output.step_id,
        forward_time_ms=output.forward_time_ms,
        sampled=[
            worker_pb2.SampledToken(
                request_id=request_id,
                token_id=token.token_id,
                logprob=token.logprob,
                top_logprobs=[
                    worker_pb2.TopLogprob(token_id=tid, logprob=lp)
                    for tid, lp in token.top_logprobs
                ],
            )
            for request_id, first in output.sampled.items()
            for token in (first, *output.spec_sampled.get(request_id, ()))
        ],
        pooled=[
            worker_pb2.PooledOutput(request_id=request_id, embedding=vector)
            for request_id, vector in output.pooled.items()
        ],
        drafts=[
            worker_pb2.DraftTokens(request_id=request_id, token_ids=tokens)
            for request_id, tokens in output.draft_token_ids.items()
        ],
    )


def worker_info_to_pb(
    info: object,
    worker_id: str,
    layout: dict[str, int],
    kv_rank: RankSlice | None = None,
    tier: HostTier | None = None,
) -> worker_pb2.GetWorkerInfoResponse:
    return worker_pb2.GetWorkerInfoResponse(
        host_tier_slots=tier.num_slots if tier is not None else 0,
        host_tier_epoch=tier.epoch if tier is not None else 0,
        kv_transfer=_rank_slice_to_pb(kv_rank) if kv_rank is not None else None,
        worker_id=worker_id,
        model=info.model_name,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        max_model_len=info.max_model_len,
        dtype=info.dtype,
        num_blocks=info.num_blocks,
        num_swap_blocks=info.num_swap_blocks,
        block_size=info.block_size,
        quantization=info.quantization,
        weight_bytes=info.weight_bytes,
        kv_cache_bytes=info.kv_cache_bytes,
        kv_cache_sizing=info.kv_cache_sizing,
        pooling=pooling_info_to_pb(info.pooling),
        image_token_id=max(info.image_token_id, 0),
        image_seq_length=info.image_seq_length,
        image_tiling=image_tiling_to_pb(info.image_tiling),
        **layout,
    )


# --- admin (pagemesh.v1.Admin's per-rank messages) ------------------------------------------


def memory_to_pb(
    memory: RankMemory, worker_id: str, layout: dict[str, int]
) -> worker_pb2.GetMemoryResponse:
    """This rank's memory; the group's block occupancy is the scheduler's to fill in."""
    return worker_pb2.GetMemoryResponse(
        memory=admin_pb2.RankMemory(
            worker_id=worker_id,
            tp_rank=max(0, layout["tp_rank"]),
            pp_rank=max(0, layout["pp_rank"]),
            device=memory.device,
            weight_bytes=memory.weight_bytes,
            num_allocated_kv_blocks=memory.num_allocated_kv_blocks,
            kv_cache_bytes=memory.kv_cache_bytes,
            kv_bytes_per_block=memory.kv_bytes_per_block,
            num_swap_blocks=memory.num_swap_blocks,
            swap_bytes=memory.swap_bytes,
            rss_bytes=memory.rss_bytes,
            device_allocated_bytes=memory.device_allocated_bytes,
            device_reserved_bytes=memory.device_reserved_bytes,
            device_total_bytes=memory.device_total_bytes,
        )
    )


def step_stats_to_pb(
    stats: StepStatsSnapshot,
    worker_id: str,
    layout: dict[str, int],
    expert_load: dict[int, list[int]] | None = None,
) -> worker_pb2.GetStepStatsResponse:
    expert_load = expert_load or {}
    return worker_pb2.GetStepStatsResponse(
        stats=admin_pb2.RankStepStats(
            worker_id=worker_id,
            tp_rank=max(0, layout["tp_rank"]),
            pp_rank=max(0, layout["pp_rank"]),
            num_steps=stats.num_steps,
            busy_s=stats.busy_s,
            collective_s=stats.collective_s,
            pp_send_s=stats.pp_send_s,
            pp_recv_s=stats.pp_recv_s,
            window_s=stats.window_s,
            window_num_steps=stats.window_num_steps,
            window_busy_s=stats.window_busy_s,
            window_communication_s=stats.window_communication_s,
            utilization=stats.utilization,
            compute_fraction=stats.compute_fraction,
            expert_load=[
                admin_pb2.ExpertLoad(layer=layer, tokens=tokens)
                for layer, tokens in sorted(expert_load.items())
            ],
        )
    )


def profile_trace_to_pb(
    trace: ProfileTraceFile, worker_id: str, layout: dict[str, int]
) -> worker_pb2.StopProfileResponse:
    return worker_pb2.StopProfileResponse(
        trace=admin_pb2.ProfileTrace(
            worker_id=worker_id,
            tp_rank=max(0, layout["tp_rank"]),
            pp_rank=max(0, layout["pp_rank"]),
            host=trace.host,
            path=trace.path,
            duration_s=trace.duration_s,
            num_steps=trace.num_steps,
        )
    )


# --- KV moving between groups (worker_svc/kv_endpoint.py) -----------------------------------


def _rank_slice_to_pb(rank: RankSlice) -> worker_pb2.KvRank:
    return worker_pb2.KvRank(
        address=rank.address,
        host_key=rank.host_key,
        layer_start=rank.layer_start,
        num_layers=rank.num_layers,
        kv_head_start=rank.kv_head_start,
        num_kv_heads=rank.num_kv_heads,
        block_size=rank.block_size,
        head_dim=rank.head_dim,
        dtype=rank.dtype,
    )


def rank_slices_from_pb(ranks: Iterable[worker_pb2.KvRank]) -> list[RankSlice]:
    """Raises ValueError for a rank whose figures cannot describe a KV cache."""
    return [
        RankSlice(
            r.layer_start,
            r.num_layers,
            r.kv_head_start,
            r.num_kv_heads,
            r.block_size,
            r.head_dim,
            r.dtype,
            r.address,
            r.host_key,
        )
        for r in ranks
    ]


def pull_result_to_pb(result: PullResult) -> worker_pb2.PullKvResponse:
    return worker_pb2.PullKvResponse(
        ok=result.ok,
        reason=result.reason,
        num_bytes=result.nbytes,
        seconds=result.seconds,
        path="+".join(sorted(result.paths)),
    )


def load_failed_pb(failed_block_ids: Iterable[int], reason: str) -> worker_pb2.LoadKvResponse:
    failed = list(failed_block_ids)
    return worker_pb2.LoadKvResponse(
        ok=not failed and not reason, reason=reason, failed_block_ids=failed
    )


def pull_failed_pb(reason: str) -> worker_pb2.PullKvResponse:
    return worker_pb2.PullKvResponse(ok=False, reason=reason)
