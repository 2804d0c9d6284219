"""The router's one bridge between protobuf and its domain types (router/types.py).

Every conversion between a `generate.v1` or `scheduler.v1` message and a domain value
happens here, and only the gRPC adapters call it: the servicer (router/servicer.py) for the
public API, the scheduler stream (router/scheduler_stream.py) for each scheduler output, and
the scheduler connection (router/scheduler_connection.py) for each request it sends and the
model info. Those adapters still build their own RPC envelopes (`ConnectRequest`,
`AbortRequest`, health and `GetModelInfo` requests) and read the stream's routing fields
(a message's request ids, its in-band errors); nothing else on the router sees protobuf.
"""

from __future__ import annotations

from pagemesh.api.options.constraint import OutputConstraint
from pagemesh.api.options.messages import sampling_message, stopping_message
from pagemesh.api.options.validation import SamplingOptions, StoppingOptions
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from protos.pooling import (
    image_tiling_from_pb,
    image_tiling_to_pb,
    pooling_info_from_pb,
    pooling_info_to_pb,
)
from protos.step import ImageInput
from router.embedding import EmbeddingRequest, EmbeddingResult
from router.resume import Progress, SampleProgress
from router.types import (
    FinishReason,
    GenerationRequest,
    KVHandoff,
    ModelInfo,
    SampleOutput,
    Submission,
    TokenChunk,
    TokenLogprob,
)


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
        images=list(pb.images),
        model=pb.model,
        constraint=constraint_from_pb(pb.constraint) if pb.HasField("constraint") else None,
    )


def constraint_from_pb(pb: generate_pb2.OutputConstraint) -> OutputConstraint:
    """A GenerateRequest's constraint; an empty one (no kind set) is `kind` "" and refused
    by router/structured.py."""
    kind = pb.WhichOneof("kind") or ""
    if kind == "choice":
        return OutputConstraint(kind, tuple(pb.choice.choices))
    if kind == "json_object":
        return OutputConstraint(kind)
    return OutputConstraint(kind, getattr(pb, kind) if kind else "")


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


def submit_request(
    submission: Submission, progress: Progress | None = None
) -> scheduler_pb2.SubmitRequest:
    """The scheduler's request for one attempt; `progress`, when given, is what each sample
    produced so far (and whether it ended): the scheduler continues after it."""
    s = submission.sampling
    stopping = submission.stopping
    request = scheduler_pb2.SubmitRequest(
        request_id=submission.request_id,
        prompt_token_ids=submission.prompt_token_ids,
        sampling=sampling_message(s),
        stopping=stopping_message(stopping),
        logprobs=submission.num_logprobs,
        n=submission.n,
        priority=submission.priority,
        grammar=submission.grammar,
        owner=submission.owner,
        request_digest=submission.request_digest,
        lora_name=submission.lora_name,
    )
    if submission.embed_dimensions is not None:
        request.embed.dimensions = submission.embed_dimensions
        request.embed.image = submission.embed_image
    request.images.extend(
        generate_pb2.ImageInput(data=i.data, offset=i.offset, length=i.length, sha256=i.digest)
        for i in submission.images
    )
    if progress is not None:
        request.progress.extend(
            _sample_progress(i, p, submission.num_logprobs > 0)
            for i, p in enumerate(progress.samples)
        )
        request.kv_handoffs.extend(
            scheduler_pb2.KvHandoff(
                index=i,
                scheduler_address=h.scheduler_address,
                handoff_id=h.handoff_id,
                num_tokens=h.num_tokens,
            )
            for i, p in enumerate(progress.samples)
            if (h := p.kv_handoff) is not None and not p.finished
        )
    return request


def _sample_progress(
    index: int, progress: SampleProgress, with_logprobs: bool
) -> scheduler_pb2.SampleProgress:
    """One sample's progress, with its logprobs when the request asks for them and there is
    one per token (the scheduler's checkpoint keeps them for a later resume)."""
    pb = scheduler_pb2.SampleProgress(
        index=index, token_ids=progress.token_ids, finished=progress.finished
    )
    if with_logprobs and len(progress.logprobs) == len(progress.token_ids):
        pb.logprobs.extend(
            scheduler_pb2.SampledLogprob(
                logprob=logprob,
                top=[generate_pb2.TopLogprob(token_id=i, logprob=lp) for i, lp in top],
            )
            for logprob, top in progress.logprobs
        )
    return pb


def submission_from_checkpoint(raw: bytes) -> Submission:
    """The request a checkpoint stores (the `SubmitRequest` as the router first sent it);
    its progress is the checkpoint's samples, read separately."""
    pb = scheduler_pb2.SubmitRequest.FromString(raw)
    return Submission(
        request_id=pb.request_id,
        prompt_token_ids=list(pb.prompt_token_ids),
        sampling=sampling_from_pb(pb.sampling),
        stopping=stopping_from_pb(pb.stopping),
        num_logprobs=pb.logprobs,
        n=pb.n,
        priority=pb.priority,
        grammar=pb.grammar,
        owner=pb.owner,
        request_digest=pb.request_digest,
        images=tuple(ImageInput(i.data, i.offset, i.length, i.sha256) for i in pb.images),
        lora_name=pb.lora_name,
    )


def sample_output(pb: scheduler_pb2.SubmitResponse) -> SampleOutput:
    """A scheduler message of one sample, converted once as it reaches the router."""
    logprobs = [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in pb.logprobs]
    handoff = pb.kv_handoff
    return SampleOutput(
        pb.index,
        list(pb.token_ids),
        finish_reason_from_pb(pb.finish_reason),
        logprobs,
        pb.embedding or None,
        pb.num_draft_tokens,
        pb.num_accepted_tokens,
        KVHandoff(pb.index, handoff.handoff_id, handoff.num_tokens) if handoff.handoff_id else None,
    )


def embedding_request(pb: generate_pb2.EmbedRequest, owner: str = "") -> EmbeddingRequest:
    """A gRPC `Embed` call's request (an input with neither text nor ids stays None)."""
    inputs: list[str | list[int] | bytes | None] = []
    for item in pb.inputs:
        kind = item.WhichOneof("input")
        inputs.append(
            item.text
            if kind == "text"
            else list(item.token_ids.ids)
            if kind == "token_ids"
            else item.image
            if kind == "image"
            else None
        )
    return EmbeddingRequest(
        inputs=inputs, model=pb.model, dimensions=pb.dimensions, priority=pb.priority, owner=owner
    )


def embed_response(result: EmbeddingResult) -> generate_pb2.EmbedResponse:
    return generate_pb2.EmbedResponse(
        request_id=result.request_id,
        embeddings=[
            generate_pb2.Embedding(index=i, values=vector.tolist())
            for i, vector in enumerate(result.vectors())
        ],
        usage=generate_pb2.Usage(prompt_tokens=result.num_prompt_tokens),
    )


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
    if finish_reason is None:
        return generate_pb2.FINISH_REASON_UNSPECIFIED
    return _FINISH_REASON_VALUES[finish_reason]


def generate_response(chunk: TokenChunk) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(
        request_id=chunk.request_id,
        index=chunk.index,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=finish_reason_to_pb(chunk.finish_reason),
    )
    if chunk.logprobs:
        response.logprobs.extend(_token_logprob(lp) for lp in chunk.logprobs)
    if chunk.usage is not None:
        response.usage.prompt_tokens = chunk.usage.num_prompt_tokens
        response.usage.completion_tokens = chunk.usage.num_completion_tokens
        response.usage.num_draft_tokens = chunk.usage.num_draft_tokens
        response.usage.num_accepted_tokens = chunk.usage.num_accepted_tokens
    return response


def _token_logprob(lp: TokenLogprob) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[
            generate_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token)
            for t in lp.top
        ],
    )


def model_info_from_pb(pb: generate_pb2.GetModelInfoResponse) -> ModelInfo:
    """A scheduler's model description; its `num_replicas` is that scheduler's own count
    (one group), which the router replaces with its own (router/group_directory.py)."""
    return ModelInfo(
        model=pb.model,
        max_model_len=pb.max_model_len,
        vocab_size=pb.vocab_size,
        eos_token_ids=list(pb.eos_token_ids),
        dtype=pb.dtype,
        architecture=pb.architecture,
        block_size=pb.block_size,
        num_kv_blocks=pb.num_kv_blocks,
        quantization=pb.quantization,
        weight_bytes=pb.weight_bytes,
        kv_cache_bytes=pb.kv_cache_bytes,
        kv_cache_sizing=pb.kv_cache_sizing,
        tensor_parallel_size=pb.layout.tensor_parallel_size,
        pipeline_parallel_size=pb.layout.pipeline_parallel_size,
        num_replicas=pb.layout.num_replicas,
        pooling=pooling_info_from_pb(pb.pooling),
        image_token_id=pb.image_token_id,
        image_seq_length=pb.image_seq_length,
        image_tiling=image_tiling_from_pb(pb.image_tiling),
    )


def model_info_response(info: ModelInfo) -> generate_pb2.GetModelInfoResponse:
    return generate_pb2.GetModelInfoResponse(
        model=info.model,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        dtype=info.dtype,
        architecture=info.architecture,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        quantization=info.quantization,
        weight_bytes=info.weight_bytes,
        kv_cache_bytes=info.kv_cache_bytes,
        kv_cache_sizing=info.kv_cache_sizing,
        layout=generate_pb2.ParallelLayout(
            tensor_parallel_size=info.tensor_parallel_size,
            pipeline_parallel_size=info.pipeline_parallel_size,
            num_replicas=info.num_replicas,
        ),
        pooling=pooling_info_to_pb(info.pooling),
        image_token_id=info.image_token_id,
        image_seq_length=info.image_seq_length,
        image_tiling=image_tiling_to_pb(info.image_tiling),
    )


def tokenize_response(token_ids: list[int], tokens: list[str]) -> generate_pb2.TokenizeResponse:
    return generate_pb2.TokenizeResponse(token_ids=token_ids, tokens=tokens)
