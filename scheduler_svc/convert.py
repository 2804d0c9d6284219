"""The only place on the scheduler that builds or reads protobuf messages: the router's
submits and the replies to them (`scheduler.proto`), the steps and worker infos of the
engine group (`worker.proto`), model info and stats (`generate.proto`). Everything else
works on plain types: `messages.py` (this service's), `protos/step.py` (the step contract)
and the core's. Three other files import generated modules, for the gRPC plumbing alone
(tests/scheduler_svc/test_protobuf_edge.py holds them to it): `servicer.py`, the adapter,
implements and registers the generated service and hands what it receives to these
functions (it reads only the request id it logs under and the model's EOS ids);
`worker_client.py` holds the workers' stubs and sends what these functions build, and
`kv_moves.py` other groups' schedulers' stubs, for their KV holds."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from pagemesh.runtime.checkpoints import TokenLogprobs
from pagemesh.runtime.registry_entries import GroupStatus
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import admin_pb2, generate_pb2
from protos.pagemesh.worker.v1 import worker_pb2
from protos.pooling import (
    image_tiling_from_pb,
    image_tiling_to_pb,
    pooling_info_from_pb,
    pooling_info_to_pb,
)
from protos.step import (
    ImageInput,
    LoraRef,
    ModelRunnerOutput,
    PoolingParams,
    RequestId,
    SampledToken,
    SamplingParams,
    SchedulerOutput,
)
from scheduler_svc.core import admission
from scheduler_svc.core.admission import expand_samples
from scheduler_svc.core.scheduler import SchedulerStats
from scheduler_svc.core.types import FinishReason, HeldKV, Request, RequestEvent
from scheduler_svc.messages import (
    Abort,
    ConnectAction,
    ConnectBatch,
    InvalidSubmit,
    KVClaim,
    KVHandoffRef,
    KVRank,
    PullResult,
    Submission,
    WorkerInfo,
)

_FINISH_REASON_TO_PB = {
    None: generate_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
}

# Fields the router may leave unset (None in the core's RequestSpec): SamplingParams'
# defaults (the one place they are written) apply to them.
_OPTIONAL_SAMPLING = ("temperature", "top_p", "repetition_penalty")


def submission_from_pb(
    pb: scheduler_pb2.SubmitRequest,
    eos_token_ids: list[int],
    arrival_time_s: float,
    loras: Mapping[str, LoraRef] = {},
) -> Submission:
    """The request as admitted: one core request per sample that still has to run (see
    `admission.expand_samples`), and the resumed samples already ended (see
    `admission.ended_samples`). Raises ValueError for a message that cannot run."""
    base = _request_from_pb(pb, eos_token_ids, arrival_time_s)
    if pb.lora_name:
        base.lora = loras.get(pb.lora_name)
        if base.lora is None:
            raise ValueError(
                f"LoRA adapter {pb.lora_name!r} is not served by this group "
                f"(it serves {', '.join(sorted(loras)) or 'none'})"
            )
    n = max(pb.n, 1)
    progress = _progress(pb)
    return Submission(
        request_id=pb.request_id,
        requests=expand_samples(base, n, progress),
        n=n,
        with_logprobs=pb.logprobs > 0,
        num_prompt_tokens=len(pb.prompt_token_ids),
        progress=progress,
        ended=admission.ended_samples(base, progress),
        trace_context=dict(pb.trace_context),
        original=_original(pb, base.images),
        progress_logprobs=_progress_logprobs(pb) if pb.logprobs > 0 else {},
        images=base.images,
        kv_handoffs={
            h.index: KVHandoffRef(h.index, h.scheduler_address, h.handoff_id, h.num_tokens)
            for h in pb.kv_handoffs
            if h.index < n and h.handoff_id
        },
    )


def connect_action_from_pb(
    pb: scheduler_pb2.ConnectRequest,
    eos_token_ids: list[int],
    arrival_time_s: float,
    loras: Mapping[str, LoraRef] = {},
) -> ConnectAction:
    """What one message up a Connect stream asks for; a submit that does not convert is
    an `InvalidSubmit`, refused for that request alone."""
    action = pb.WhichOneof("action")
    if action == "submit":
        try:
            return submission_from_pb(pb.submit, eos_token_ids, arrival_time_s, loras)
        except ValueError as exc:
            return InvalidSubmit(pb.submit.request_id, str(exc))
    if action == "abort":
        return Abort(pb.abort.request_id)
    return None


def _original(pb: scheduler_pb2.SubmitRequest, images: tuple[ImageInput, ...]) -> bytes:
    """The request as first submitted, for its checkpoint: progress is kept apart, and each
    image as its SHA-256 alone (its bytes go to the image store, once per image)."""
    original = scheduler_pb2.SubmitRequest()
    original.CopyFrom(pb)
    original.ClearField("progress")
    original.ClearField("trace_context")
    original.ClearField("kv_handoffs")
    for image, converted in zip(original.images, images):
        image.sha256 = converted.digest
        image.data = b""
    return original.SerializeToString()


def _image_from_pb(pb: generate_pb2.ImageInput) -> ImageInput:
    """An image of a request, its SHA-256 computed here once (the prefix cache's block
    hashes and the checkpoint's image store key on it)."""
    if not pb.data:
        raise ValueError(
            f"the image over prompt positions {pb.offset}..."
            f"{pb.offset + pb.length - 1} has no bytes"
        )
    return ImageInput(pb.data, pb.offset, pb.length, hashlib.sha256(pb.data).digest())


def _progress(pb: scheduler_pb2.SubmitRequest) -> dict[int, tuple[list[int], bool]]:
    return {p.index: (list(p.token_ids), p.finished) for p in pb.progress}


def _progress_logprobs(pb: scheduler_pb2.SubmitRequest) -> dict[int, list[TokenLogprobs]]:
    """Per sample, the logprobs its progress came with, when there is one per token."""
    return {
        p.index: [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in p.logprobs]
        for p in pb.progress
        if len(p.logprobs) == len(p.token_ids)
    }


def _request_from_pb(
    pb: scheduler_pb2.SubmitRequest, eos_token_ids: list[int], arrival_time_s: float
) -> Request:
    """Fields mapped to the core's door (`admission.core_request`), which holds the rules."""
    sampling, stopping = pb.sampling, pb.stopping
    unset_is_none = {
        name: getattr(sampling, name) if sampling.HasField(name) else None
        for name in _OPTIONAL_SAMPLING
    }
    return admission.core_request(
        admission.RequestSpec(
            request_id=pb.request_id,
            prompt_token_ids=pb.prompt_token_ids,
            seed=sampling.seed if sampling.HasField("seed") else None,
            max_tokens=stopping.max_tokens,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            min_tokens=stopping.min_tokens,
            stop_token_ids=stopping.stop_token_ids,
            ignore_eos=stopping.ignore_eos,
            num_logprobs=pb.logprobs,
            grammar=pb.grammar,
            priority=pb.priority,
            pooling=(
                PoolingParams(pb.embed.dimensions, pb.embed.image) if pb.HasField("embed") else None
            ),
            images=tuple(_image_from_pb(i) for i in pb.images),
            **unset_is_none,
        ),
        eos_token_ids,
        arrival_time_s,
    )


def _sampling_to_pb(s: SamplingParams) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        min_tokens=s.min_tokens,
        stop_token_ids=s.stop_token_ids,
        num_logprobs=s.num_logprobs,
        grammar=s.grammar,
    )


def scheduler_output_to_pb(
    output: SchedulerOutput,
    traceparents: dict[str, str] | None = None,
    session_id: str = "",
    sequence: int = 0,
) -> worker_pb2.ExecuteStepRequest:
    """The step for the workers; `traceparents`: the traced requests' span contexts;
    `session_id`, `sequence`: the order a group's workers run overlapping steps in."""
    step = worker_pb2.ExecuteStepRequest(
        step_id=output.step_id,
        session_id=session_id,
        sequence=sequence,
        new_requests=[
            worker_pb2.NewRequest(
                request_id=new.request_id,
                token_ids=new.token_ids,
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                sampling=_sampling_to_pb(new.sampling),
                pooling=(
                    None
                    if new.pooling is None
                    else worker_pb2.PoolingParams(
                        dimensions=new.pooling.dimensions, image=new.pooling.image
                    )
                ),
                images=[
                    generate_pb2.ImageInput(
                        data=i.data, offset=i.offset, length=i.length, sha256=i.digest
                    )
                    for i in new.images
                ],
                lora=(
                    worker_pb2.LoraAdapterRef(name=new.lora.name, path=new.lora.path)
                    if new.lora is not None
                    else None
                ),
            )
            for new in output.new_requests
        ],
        cached_requests=[
            worker_pb2.CachedRequest(
                request_id=cached.request_id,
                new_block_ids=cached.new_block_ids,
                num_computed_tokens=cached.num_computed_tokens,
                new_token_ids=cached.new_token_ids,
                spec_token_ids=cached.spec_token_ids,
            )
            for cached in output.cached_requests
        ],
        num_scheduled_tokens=output.num_scheduled_tokens,
        finished_request_ids=output.finished_request_ids,
        blocks_to_swap_out=_pairs(output.blocks_to_swap_out),
        blocks_to_swap_in=_pairs(output.blocks_to_swap_in),
        blocks_to_copy=_pairs(output.blocks_to_copy),
        blocks_to_offload=[
            worker_pb2.TierStore(block=b, slot=s, key=k) for b, s, k in output.blocks_to_offload
        ],
        append_sampled_tokens=output.append_sampled_tokens,
    )
    if traceparents:
        step.traceparents.update(traceparents)
    return step


def _pairs(pairs: list[tuple[int, int]]) -> list[worker_pb2.BlockPair]:
    return [worker_pb2.BlockPair(src=src, dst=dst) for src, dst in pairs]


def model_runner_output_from_pb(pb: worker_pb2.ExecuteStepResponse) -> ModelRunnerOutput:
    """A request's first entry is its sampled token; later entries of the same request are
    the tokens of its accepted drafts (speculative decoding), in order."""
    sampled: dict[RequestId, SampledToken] = {}
    spec_sampled: dict[RequestId, list[SampledToken]] = {}
    for s in pb.sampled:
        token = SampledToken(
            token_id=s.token_id,
            logprob=s.logprob,
            top_logprobs=tuple((t.token_id, t.logprob) for t in s.top_logprobs),
        )
        request_id = RequestId(s.request_id)
        if request_id in sampled:
            spec_sampled.setdefault(request_id, []).append(token)
        else:
            sampled[request_id] = token
    return ModelRunnerOutput(
        step_id=pb.step_id,
        sampled=sampled,
        spec_sampled=spec_sampled,
        pooled={RequestId(p.request_id): p.embedding for p in pb.pooled},
        draft_token_ids={RequestId(d.request_id): list(d.token_ids) for d in pb.drafts},
    )


def finish_reason_to_pb(reason: FinishReason | None) -> int:
    return _FINISH_REASON_TO_PB[reason]


def event_to_pb(
    event: RequestEvent, index: int, with_logprobs: bool, request_id: str = ""
) -> scheduler_pb2.SubmitResponse:
    """One sample's event (`index`: the sample); `request_id` is set on a Connect stream."""
    response = scheduler_pb2.SubmitResponse(
        request_id=request_id,
        index=index,
        token_ids=[t.token_id for t in event.new_tokens],
        finish_reason=_FINISH_REASON_TO_PB[event.finish_reason],
        num_prompt_tokens=event.num_prompt_tokens,
        embedding=event.embedding or b"",
        num_draft_tokens=event.num_draft_tokens,
        num_accepted_tokens=event.num_accepted_tokens,
    )
    if event.handoff is not None:  # the router fills in this scheduler's address
        response.kv_handoff.CopyFrom(
            scheduler_pb2.KvHandoff(
                index=index,
                handoff_id=event.handoff.request_id,
                num_tokens=len(event.handoff.token_ids),
            )
        )
    if with_logprobs:
        response.logprobs.extend(
            scheduler_pb2.SampledLogprob(
                logprob=t.logprob,
                top=[generate_pb2.TopLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs],
            )
            for t in event.new_tokens
        )
    return response


def connect_batch_to_pb(batch: ConnectBatch) -> scheduler_pb2.ConnectResponse:
    return scheduler_pb2.ConnectResponse(
        outputs=[
            event_to_pb(event, index, with_logprobs, request_id)
            for request_id, index, event, with_logprobs in batch.outputs
        ],
        errors=[
            scheduler_pb2.RequestError(
                request_id=e.request_id, code=e.code.value[0], message=e.message
            )
            for e in batch.errors
        ],
    )


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
        kv_rank=_kv_rank_from_pb(pb.kv_transfer) if pb.kv_transfer.address else None,
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


# --- admin (pagemesh.v1.Admin, forwarded to the workers) ------------------------------------

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


# ---- KV moving between groups (scheduler_svc/kv_moves.py) ------------------------------------


def _kv_rank_from_pb(pb: worker_pb2.KvRank) -> KVRank:
    return KVRank(
        pb.address,
        pb.host_key,
        pb.layer_start,
        pb.num_layers,
        pb.kv_head_start,
        pb.num_kv_heads,
        pb.block_size,
        pb.head_dim,
        pb.dtype,
    )


def _kv_rank_to_pb(rank: KVRank) -> worker_pb2.KvRank:
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


def claim_request_pb(handoff_id: str, hold_ms: int) -> scheduler_pb2.ClaimKvRequest:
    return scheduler_pb2.ClaimKvRequest(handoff_id=handoff_id, hold_ms=hold_ms)


def claim_response_pb(
    held: HeldKV, ranks: Sequence[KVRank], token: str
) -> scheduler_pb2.ClaimKvResponse:
    return scheduler_pb2.ClaimKvResponse(
        block_ids=held.block_ids,
        token_ids=held.token_ids,
        ranks=[_kv_rank_to_pb(rank) for rank in ranks],
        transfer_token=token,
    )


def claim_from_pb(pb: scheduler_pb2.ClaimKvResponse) -> KVClaim:
    return KVClaim(
        tuple(pb.block_ids),
        tuple(pb.token_ids),
        tuple(_kv_rank_from_pb(rank) for rank in pb.ranks),
        pb.transfer_token,
    )


def release_request_pb(
    handoff_id: str, pulled: bool, reason: str
) -> scheduler_pb2.ReleaseKvRequest:
    return scheduler_pb2.ReleaseKvRequest(handoff_id=handoff_id, pulled=pulled, reason=reason)


def pull_request_pb(
    transfer_id: str,
    claim: KVClaim,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    timeout_ms: int,
) -> worker_pb2.PullKvRequest:
    return worker_pb2.PullKvRequest(
        transfer_id=transfer_id,
        sources=[_kv_rank_to_pb(rank) for rank in claim.ranks],
        src_block_ids=src_block_ids,
        dst_block_ids=dst_block_ids,
        timeout_ms=timeout_ms,
        transfer_token=claim.transfer_token,
    )


def load_request_pb(
    slots: Sequence[int], dst_block_ids: Sequence[int], keys: Sequence[bytes], epoch: int
) -> worker_pb2.LoadKvRequest:
    return worker_pb2.LoadKvRequest(
        slots=slots, dst_block_ids=dst_block_ids, keys=keys, epoch=epoch
    )


def pull_result_from_pb(pb: worker_pb2.PullKvResponse) -> PullResult:
    return PullResult(pb.ok, pb.reason, pb.num_bytes, pb.seconds, pb.path)


def drain_response_pb(
    groups: Sequence[str], num_migrated: int, num_recomputed: int
) -> admin_pb2.DrainResponse:
    return admin_pb2.DrainResponse(
        groups=groups, num_migrated=num_migrated, num_recomputed=num_recomputed
    )
