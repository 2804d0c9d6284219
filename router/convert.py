"""The only place on the router that touches protobuf types."""

from __future__ import annotations

from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from router.resume import Progress
from router.validation import ModelLimits, SamplingOptions, StoppingOptions, ValidatedRequest


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


def replayed_response(index: int, token_ids: list[int], finish_reason: int) -> scheduler_pb2.SubmitResponse:
    """Checkpointed tokens of one sample, replayed as if its scheduler had just sent them."""
    return scheduler_pb2.SubmitResponse(index=index, token_ids=token_ids, finish_reason=finish_reason)


def without_leading_tokens(response: scheduler_pb2.SubmitResponse, num_tokens: int
                           ) -> scheduler_pb2.SubmitResponse:
    """`response` less its first `num_tokens` tokens (and their logprobs)."""
    rest = scheduler_pb2.SubmitResponse()
    rest.CopyFrom(response)
    del rest.token_ids[:num_tokens]
    del rest.logprobs[:num_tokens]
    return rest


def token_logprobs(
    response: scheduler_pb2.SubmitResponse, token_text: dict[int, str]
) -> list[generate_pb2.TokenLogprob]:
    """Per-token logprobs of a scheduler message, with each token's text from `token_text`."""
    return [
        generate_pb2.TokenLogprob(
            token_id=token_id,
            logprob=lp.logprob,
            top=[
                generate_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob,
                                        token=token_text.get(t.token_id, ""))
                for t in lp.top
            ],
        )
        for token_id, lp in zip(response.token_ids, response.logprobs)
    ]


FINISH_REASON_STOP = generate_pb2.FINISH_REASON_STOP
FINISH_REASON_UNSPECIFIED = generate_pb2.FINISH_REASON_UNSPECIFIED


def finish_reason_name(finish_reason: int) -> str:
    """"stop", "length" or "abort", as OpenAI and the GenAI trace conventions spell them."""
    return generate_pb2.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()


def generate_response(
    request_id: str,
    index: int,
    token_ids: list[int],
    text: str,
    logprobs: list[generate_pb2.TokenLogprob],
    finish_reason: int = FINISH_REASON_UNSPECIFIED,
    num_prompt_tokens: int = 0,
    num_completion_tokens: int = 0,
) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(
        request_id=request_id, index=index, token_ids=token_ids, text=text, logprobs=logprobs,
        finish_reason=finish_reason,
    )
    if num_prompt_tokens:
        response.usage.prompt_tokens = num_prompt_tokens
        response.usage.completion_tokens = num_completion_tokens
    return response


def tokenize_response(token_ids: list[int], tokens: list[str]) -> generate_pb2.TokenizeResponse:
    return generate_pb2.TokenizeResponse(token_ids=token_ids, tokens=tokens)
