"""The only place on the router that touches protobuf types."""

from __future__ import annotations

from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from router.resume import Progress
from router.types import (FinishReason, GenerationRequest, ModelInfo, SampleOutput, TokenChunk,
                          TokenLogprob)
from router.validation import ModelLimits, SamplingOptions, StoppingOptions, ValidatedRequest


def generation_request(pb: generate_pb2.GenerateRequest) -> GenerationRequest:
    """A gRPC `Generate` call's request; unset fields stay unset (None) for validation."""
    prompt_kind = pb.WhichOneof("prompt")
    prompt: str | list[int] | None = None
    if prompt_kind == "text":
        prompt = pb.text
    elif prompt_kind == "token_ids":
        prompt = list(pb.token_ids.ids)
    return GenerationRequest(
        request_id=pb.request_id,
        prompt=prompt,
        apply_chat_template=pb.apply_chat_template,
        sampling=sampling_from_pb(pb.sampling),
        stopping=stopping_from_pb(pb.stopping),
        num_logprobs=pb.logprobs or None,
        n=pb.n or 1,
        priority=pb.priority,
        resume_from=pb.resume_from,
        model=pb.model,
    )


def sampling_from_pb(pb: generate_pb2.SamplingParams) -> SamplingOptions:
    return SamplingOptions(
        temperature=pb.temperature if pb.HasField("temperature") else None,
        top_p=pb.top_p if pb.HasField("top_p") else None,
        top_k=pb.top_k,
        min_p=pb.min_p,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else None,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        seed=pb.seed if pb.HasField("seed") else None,
    )


def stopping_from_pb(pb: generate_pb2.StoppingCriteria) -> StoppingOptions:
    return StoppingOptions(
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else None,
        min_tokens=pb.min_tokens,
        stop=list(pb.stop),
        stop_token_ids=list(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
    )


def limits_from_pb(info: generate_pb2.GetModelInfoResponse) -> ModelLimits:
    return ModelLimits(
        name=info.model,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
    )


def submit_request(request_id: str, validated: ValidatedRequest, seed: int) -> scheduler_pb2.SubmitRequest:
    """The scheduler's request; `seed` replaces an unset one so every request is replayable.

    The stop strings travel too, though the scheduler ignores them: its checkpoint keeps this
    message, and a router resuming the request after this one died reads them from there."""
    s = validated.sampling
    stopping = validated.stopping
    return scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=validated.prompt_token_ids,
        sampling=generate_pb2.SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            seed=s.seed if s.seed is not None else seed,
        ),
        stopping=generate_pb2.StoppingCriteria(
            max_tokens=stopping.max_tokens,
            min_tokens=stopping.min_tokens,
            stop=stopping.stop,
            stop_token_ids=stopping.stop_token_ids,
            ignore_eos=stopping.ignore_eos,
        ),
        logprobs=validated.num_logprobs or 0,
        n=validated.n,
        priority=validated.priority,
    )


def with_progress(request: scheduler_pb2.SubmitRequest, progress: Progress) -> scheduler_pb2.SubmitRequest:
    """`request` resumed: every sample's output so far (and whether it ended) as `progress`."""
    resumed = scheduler_pb2.SubmitRequest()
    resumed.CopyFrom(request)
    del resumed.progress[:]
    resumed.progress.extend(
        scheduler_pb2.SampleProgress(index=i, token_ids=s.token_ids, finished=s.finished)
        for i, s in enumerate(progress.samples)
    )
    return resumed


def submit_from_checkpoint(raw: bytes) -> scheduler_pb2.SubmitRequest:
    """The `SubmitRequest` a checkpoint stores, as the router first sent it (no progress)."""
    request = scheduler_pb2.SubmitRequest.FromString(raw)
    del request.progress[:]
    return request


def sample_output(pb: scheduler_pb2.SubmitResponse) -> SampleOutput:
    """A scheduler message of one sample, converted once as it reaches the router."""
    logprobs = [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in pb.logprobs]
    return SampleOutput(pb.index, list(pb.token_ids), finish_reason_from_pb(pb.finish_reason),
                        logprobs)


FINISH_REASON_STOP = generate_pb2.FINISH_REASON_STOP
FINISH_REASON_UNSPECIFIED = generate_pb2.FINISH_REASON_UNSPECIFIED

# The router's one finish-reason table: the wire's enum values and the domain's names.
_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    generate_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    generate_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_FINISH_REASON_VALUES = {reason: value for value, reason in _FINISH_REASONS.items()}


def finish_reason_from_pb(finish_reason: int) -> FinishReason | None:
    """None while the sample runs (FINISH_REASON_UNSPECIFIED)."""
    return _FINISH_REASONS.get(finish_reason)


def finish_reason_to_pb(finish_reason: FinishReason | None) -> int:
    return FINISH_REASON_UNSPECIFIED if finish_reason is None else _FINISH_REASON_VALUES[finish_reason]


def generate_response(chunk: TokenChunk) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(
        request_id=chunk.request_id, index=chunk.index, token_ids=chunk.token_ids, text=chunk.text,
        finish_reason=finish_reason_to_pb(chunk.finish_reason),
    )
    if chunk.logprobs:
        response.logprobs.extend(_token_logprob(lp) for lp in chunk.logprobs)
    if chunk.usage is not None:
        response.usage.prompt_tokens = chunk.usage.num_prompt_tokens
        response.usage.completion_tokens = chunk.usage.num_completion_tokens
    return response


def _token_logprob(lp: TokenLogprob) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[generate_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token)
             for t in lp.top])


def model_info_from_pb(pb: generate_pb2.GetModelInfoResponse, num_replicas: int) -> ModelInfo:
    """The schedulers' model description, with the router's count of engine groups."""
    return ModelInfo(
        model=pb.model, max_model_len=pb.max_model_len, vocab_size=pb.vocab_size,
        eos_token_ids=list(pb.eos_token_ids), dtype=pb.dtype, architecture=pb.architecture,
        block_size=pb.block_size, num_kv_blocks=pb.num_kv_blocks, quantization=pb.quantization,
        weight_bytes=pb.weight_bytes, kv_cache_bytes=pb.kv_cache_bytes,
        kv_cache_sizing=pb.kv_cache_sizing,
        tensor_parallel_size=pb.layout.tensor_parallel_size,
        pipeline_parallel_size=pb.layout.pipeline_parallel_size,
        num_replicas=num_replicas,
    )


def model_info_response(info: ModelInfo) -> generate_pb2.GetModelInfoResponse:
    return generate_pb2.GetModelInfoResponse(
        model=info.model, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids, dtype=info.dtype, architecture=info.architecture,
        block_size=info.block_size, num_kv_blocks=info.num_kv_blocks,
        quantization=info.quantization, weight_bytes=info.weight_bytes,
        kv_cache_bytes=info.kv_cache_bytes, kv_cache_sizing=info.kv_cache_sizing,
        layout=generate_pb2.ParallelLayout(tensor_parallel_size=info.tensor_parallel_size,
                                           pipeline_parallel_size=info.pipeline_parallel_size,
                                           num_replicas=info.num_replicas),
    )


def tokenize_response(token_ids: list[int], tokens: list[str]) -> generate_pb2.TokenizeResponse:
    return generate_pb2.TokenizeResponse(token_ids=token_ids, tokens=tokens)
