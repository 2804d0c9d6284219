"""The router's side of the scheduler (`scheduler.proto`): a `SubmitRequest` (alone, or up
a Connect stream) read into this service's `Submission` of core requests, and each sample's
`RequestEvent` written back as a `SubmitResponse` (in a `ConnectResponse` on a stream)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from pagemesh.runtime.checkpoints import TokenLogprobs
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from protos.step import ImageInput, LoraRef, PoolingParams
from scheduler_svc.core import admission
from scheduler_svc.core.admission import expand_samples
from scheduler_svc.core.types import FinishReason, Request, RequestEvent
from scheduler_svc.messages import (
    Abort,
    ConnectAction,
    ConnectBatch,
    InvalidSubmit,
    KVHandoffRef,
    Submission,
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
