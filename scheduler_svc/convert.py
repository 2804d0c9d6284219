"""The only place on the scheduler that touches protobuf types."""

from __future__ import annotations

import dataclasses

from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from protos.pagemesh.worker.v1 import worker_pb2
from scheduler_svc.core.scheduler import SchedulerStats
from scheduler_svc.core.types import (
    FinishReason,
    NewRequestSchedule,
    Request,
    RequestEvent,
    RequestId,
    SampledToken,
    SamplingSpec,
    SchedulerOutput,
    StepResult,
)

_FINISH_REASON_TO_PB = {
    None: generate_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
}


def requests_from_pb(
    pb: scheduler_pb2.SubmitRequest, eos_token_ids: list[int], arrival_time_s: float, seed: int
) -> list[Request]:
    """One core request per sample: `<id>` for n = 1, else `<id>#<i>` forking from sample 0
    with seed + i. `seed` is used when the router left the seed unset."""
    leader = _request_from_pb(pb, eos_token_ids, arrival_time_s, seed)
    if pb.progress:
        return _resumed_samples(pb, leader)
    if pb.n <= 1:
        return [leader]
    leader.request_id = RequestId(f"{pb.request_id}#0")
    samples = [leader]
    for i in range(1, pb.n):
        sampling = dataclasses.replace(leader.sampling, seed=(leader.sampling.seed + i) % 2**64)
        samples.append(dataclasses.replace(
            leader, request_id=RequestId(f"{pb.request_id}#{i}"), sampling=sampling,
            prompt_token_ids=list(leader.prompt_token_ids), output_token_ids=[], block_ids=[],
            fork_of=leader.request_id,
        ))
    return samples


def sample_index(request_id: str, n: int) -> int:
    """Which sample a core request id (`<id>` or `<id>#<i>`) stands for."""
    return int(request_id.rsplit("#", 1)[1]) if n > 1 else 0


def _resumed_samples(pb: scheduler_pb2.SubmitRequest, base: Request) -> list[Request]:
    """A resumed request: each unfinished sample with the outputs it already has (its KV
    is recomputed; its next draw is at the same position with the same seed as before).
    No forks: each sample's prompt blocks come from the prefix cache instead."""
    n = max(pb.n, 1)
    progress = {p.index: p for p in pb.progress}
    if any(i >= n for i in progress):
        raise ValueError(f"progress names sample {max(progress)} but the request has n={n}")
    samples = []
    for i in range(n):
        done = progress.get(i)
        if done is not None and done.finished:
            continue
        outputs = list(done.token_ids) if done is not None else []
        if _ended(base, outputs) is not None:
            continue  # see ended_samples
        samples.append(dataclasses.replace(
            base, request_id=RequestId(pb.request_id if n == 1 else f"{pb.request_id}#{i}"),
            sampling=dataclasses.replace(base.sampling, seed=(base.sampling.seed + i) % 2**64),
            prompt_token_ids=list(base.prompt_token_ids), output_token_ids=outputs, block_ids=[],
        ))
    return samples


def ended_samples(pb: scheduler_pb2.SubmitRequest, eos_token_ids: list[int]
                  ) -> list[tuple[int, FinishReason]]:
    """Resumed samples not marked finished whose tokens already end them (the router lost
    the last message): each gets its final message at once instead of running."""
    base = _request_from_pb(pb, eos_token_ids, 0.0, 0)
    return [(p.index, reason) for p in pb.progress if not p.finished
            and (reason := _ended(base, list(p.token_ids))) is not None]


def _ended(request: Request, outputs: list[int]) -> FinishReason | None:
    if len(outputs) >= request.max_tokens:
        return FinishReason.LENGTH
    if outputs and outputs[-1] in request.stop_token_ids and len(outputs) >= request.min_tokens:
        return FinishReason.STOP
    return None


def _request_from_pb(
    pb: scheduler_pb2.SubmitRequest, eos_token_ids: list[int], arrival_time_s: float, seed: int
) -> Request:
    sampling = pb.sampling
    stopping = pb.stopping
    stop_ids = set(stopping.stop_token_ids)
    if not stopping.ignore_eos:
        stop_ids.update(eos_token_ids)
    return Request(
        request_id=RequestId(pb.request_id),
        prompt_token_ids=list(pb.prompt_token_ids),
        sampling=SamplingSpec(
            temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
            top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            repetition_penalty=(
                sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0
            ),
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            seed=sampling.seed if sampling.HasField("seed") else seed,
            num_logprobs=pb.logprobs,
        ),
        max_tokens=stopping.max_tokens,
        min_tokens=stopping.min_tokens,
        stop_token_ids=frozenset(stop_ids),
        arrival_time_s=arrival_time_s,
        priority=pb.priority,
    )


def _sampling_to_pb(new: NewRequestSchedule) -> worker_pb2.SamplingParams:
    s = new.sampling
    return worker_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        min_tokens=new.min_tokens,
        stop_token_ids=sorted(new.stop_token_ids),
        num_logprobs=s.num_logprobs,
    )


def step_to_pb(output: SchedulerOutput, traceparents: dict[str, str] | None = None
               ) -> worker_pb2.ExecuteStepRequest:
    """The step for the workers; `traceparents`: the traced requests' span contexts."""
    step = worker_pb2.ExecuteStepRequest(
        step_id=output.step_id,
        new_requests=[
            worker_pb2.NewRequest(
                request_id=new.request_id,
                token_ids=new.token_ids,
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                sampling=_sampling_to_pb(new),
            )
            for new in output.new_requests
        ],
        cached_requests=[
            worker_pb2.CachedRequest(
                request_id=cached.request_id,
                new_block_ids=cached.new_block_ids,
                num_computed_tokens=cached.num_computed_tokens,
                new_token_ids=cached.new_token_ids,
            )
            for cached in output.cached_requests
        ],
        num_scheduled_tokens=output.num_scheduled_tokens,
        finished_request_ids=output.finished_request_ids,
        blocks_to_swap_out=_pairs(output.blocks_to_swap_out),
        blocks_to_swap_in=_pairs(output.blocks_to_swap_in),
        blocks_to_copy=_pairs(output.blocks_to_copy),
        append_sampled_tokens=output.append_sampled_tokens,
    )
    if traceparents:
        step.traceparents.update(traceparents)
    return step


def _pairs(pairs: list[tuple[int, int]]) -> list[worker_pb2.BlockPair]:
    return [worker_pb2.BlockPair(src=src, dst=dst) for src, dst in pairs]


def step_result_from_pb(pb: worker_pb2.ExecuteStepResponse) -> StepResult:
    return StepResult(
        step_id=pb.step_id,
        sampled={
            RequestId(s.request_id): SampledToken(
                token_id=s.token_id,
                logprob=s.logprob,
                top_logprobs=tuple((t.token_id, t.logprob) for t in s.top_logprobs),
            )
            for s in pb.sampled
        },
    )


def finish_reason_to_pb(reason: FinishReason | None) -> int:
    return _FINISH_REASON_TO_PB[reason]


def event_to_pb(event: RequestEvent, index: int, with_logprobs: bool) -> scheduler_pb2.SubmitResponse:
    response = scheduler_pb2.SubmitResponse(
        index=index,
        token_ids=[t.token_id for t in event.new_tokens],
        finish_reason=_FINISH_REASON_TO_PB[event.finish_reason],
        num_prompt_tokens=event.num_prompt_tokens,
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


def model_info_to_pb(info: worker_pb2.GetWorkerInfoResponse, num_blocks: int,
                     weight_bytes: int | None = None, kv_cache_bytes: int | None = None
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
        layout=generate_pb2.ParallelLayout(
            tensor_parallel_size=info.tp_size,
            pipeline_parallel_size=info.pp_size,
            num_replicas=1,
        ),
    )


def stats_to_pb(stats: SchedulerStats, num_steps: int, status: str = "ready",
                num_recoveries: int = 0) -> scheduler_pb2.GetStatsResponse:
    return scheduler_pb2.GetStatsResponse(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_free_blocks=stats.num_free_blocks,
        num_blocks=stats.num_blocks,
        num_preemptions=stats.num_preemptions,
        num_steps=num_steps,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        num_cached_blocks=stats.num_cached_blocks,
        status=status,
        num_recoveries=num_recoveries,
    )
