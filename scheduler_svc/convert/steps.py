"""The engine group's step (`worker.proto`): a `SchedulerOutput` (protos/step.py) written as
the `ExecuteStepRequest` every worker of the group runs, and the driver's
`ExecuteStepResponse` read back as a `ModelRunnerOutput`."""

from __future__ import annotations

from protos.pagemesh.v1 import generate_pb2
from protos.pagemesh.worker.v1 import worker_pb2
from protos.step import (
    ModelRunnerOutput,
    RequestId,
    SampledToken,
    SamplingParams,
    SchedulerOutput,
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
