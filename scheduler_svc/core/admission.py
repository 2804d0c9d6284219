"""Checks on arriving requests and on sampled tokens; pure functions of a request.

`core_request` is the door every caller uses, on plain types: the scheduler service maps a
`SubmitRequest`'s fields to a `RequestSpec` (scheduler_svc/convert/requests.py), the offline `LLM`
builds one directly, and both get the same rules (an id, a seed, EOS among the stop ids
unless ignored, the defaults of fields left unset)."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Container, Mapping, Sequence

from protos.step import ImageInput, LoraRef, PoolingParams, RequestId, SamplingParams
from scheduler_svc.core.config import CapacityError, SchedulerConfig
from scheduler_svc.core.types import (
    FINISHED_STATUS,
    FinishReason,
    Request,
    RequestStatus,
)

SEED_MODULUS = 2**64


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """What a caller asks the engine to run, before the admission rules: plain values, with
    None where a field was left unset (its SamplingParams default applies)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    seed: int | None  # required: the caller draws it, so that any scheduler resumes alike
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    num_logprobs: int = 0
    grammar: str = ""
    priority: int = 0
    pooling: PoolingParams | None = None  # an embedding request (max_tokens is then 1)
    images: tuple[ImageInput, ...] = ()  # a vision-language prompt's images
    lora: LoraRef | None = None  # the LoRA adapter it runs with; None = the base model


_DEFAULTED = ("temperature", "top_p", "repetition_penalty")  # None: SamplingParams' default


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def core_request(spec: RequestSpec, eos_token_ids: Sequence[int], arrival_time_s: float) -> Request:
    """The core request `spec` asks for; raises ValueError for one that cannot run."""
    if not spec.request_id:
        raise ValueError("request_id is empty: every request needs an id")
    if spec.seed is None:
        raise ValueError("sampling.seed is unset: send the seed the request draws with")
    stop_ids = set(spec.stop_token_ids)
    if not spec.ignore_eos:
        stop_ids.update(eos_token_ids)
    # Floats as float32, as the wire carries them and the sampler's tensors hold them: a
    # request sampled in-process draws exactly what it draws through the mesh.
    given = {
        name: _f32(getattr(spec, name)) for name in _DEFAULTED if getattr(spec, name) is not None
    }
    return Request(
        request_id=RequestId(spec.request_id),
        prompt_token_ids=list(spec.prompt_token_ids),
        sampling=SamplingParams(
            top_k=spec.top_k,
            min_p=_f32(spec.min_p),
            presence_penalty=_f32(spec.presence_penalty),
            frequency_penalty=_f32(spec.frequency_penalty),
            seed=spec.seed,
            min_tokens=spec.min_tokens,
            stop_token_ids=tuple(sorted(stop_ids)),
            num_logprobs=spec.num_logprobs,
            grammar=spec.grammar,
            **given,
        ),
        max_tokens=spec.max_tokens,
        arrival_time_s=arrival_time_s,
        priority=spec.priority,
        pooling=spec.pooling,
        images=tuple(spec.images),
        lora=spec.lora,
    )


def check_admissible(
    request: Request, config: SchedulerConfig, live_ids: Container[RequestId]
) -> None:
    """Raises ValueError for a request that cannot be queued, CapacityError (a ValueError)
    for one that could never fit the KV cache however long it waited."""
    if request.request_id in live_ids:
        raise ValueError(f"request id {request.request_id!r} is already in flight")
    if request.lora is not None and not config.max_loras:
        raise ValueError(
            f"the request names LoRA adapter {request.lora.name!r}, but LoRA is "
            "off here (start with --enable-lora)"
        )
    if (request.pooling is not None) != config.pooling.embeds:
        raise ValueError(
            "this is an embedding model: it does not generate text; send it embedding requests"
            if config.pooling.embeds
            else "this model generates: start it with --task embed to embed"
        )
    # An embedding request computes its prompt only.
    max_len = request.num_prompt_tokens + (request.max_tokens if request.pooling is None else 0)
    if max_len > config.max_model_len:
        raise ValueError(
            f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.max_tokens}) "
            f"exceeds max_model_len ({config.max_model_len})"
            if request.pooling is None
            else f"input of {request.num_prompt_tokens} tokens exceeds max_model_len "
            f"({config.max_model_len})"
        )
    num_blocks = -(-max_len // config.block_size)
    if num_blocks > config.num_blocks:
        raise CapacityError(
            f"request needs up to {num_blocks} KV blocks but the cache has "
            f"{config.num_blocks}; lower max_tokens or shorten the prompt"
        )


def check_samples(requests: list[Request]) -> None:
    """The samples of one n > 1 request: `requests[0]` leads; the others share its prompt
    and fork from it."""
    if not requests:
        raise ValueError("empty list of samples: a request has at least one")
    leader, forks = requests[0], requests[1:]
    if leader.fork_of is not None:
        raise ValueError(f"sample 0 ({leader.request_id}) must not fork")
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("duplicate request ids among the samples")
    for fork in forks:
        if fork.fork_of != leader.request_id:
            raise ValueError(f"request {fork.request_id} must fork from {leader.request_id}")
        if fork.prompt_token_ids != leader.prompt_token_ids:
            raise ValueError(f"request {fork.request_id}: a fork's prompt must be its leader's")


def finish_reason(request: Request, output_token_ids: Sequence[int]) -> FinishReason | None:
    """How `request` ends once `output_token_ids` are its outputs, or None while it runs.

    The one stop rule, applied live and to a resumed request's outputs alike: a last token
    that is a stop id (EOS unless ignored) ends it STOP once `min_tokens` exist, also when
    it is the `max_tokens`-th token (vLLM's order); otherwise `max_tokens` outputs end it
    LENGTH."""
    num_output = len(output_token_ids)
    if (
        num_output
        and output_token_ids[-1] in request.stop_token_ids
        and num_output >= request.min_tokens
    ):
        return FinishReason.STOP
    if num_output >= request.max_tokens:
        return FinishReason.LENGTH
    return None


def stop_status(request: Request) -> RequestStatus | None:
    """The finished status a request reaches with the token just appended, or None."""
    reason = finish_reason(request, request.output_token_ids)
    return None if reason is None else FINISHED_STATUS[reason]


def sample_request_id(request_id: str, index: int, n: int) -> RequestId:
    """The core request of sample `index` of `n`: `<id>` for n = 1, else `<id>#<index>`."""
    return RequestId(request_id if n == 1 else f"{request_id}#{index}")


def sample_index(request_id: str, n: int) -> int:
    """Which sample a core request id (`<id>` or `<id>#<i>`) stands for."""
    return int(request_id.rsplit("#", 1)[1]) if n > 1 else 0


def expand_samples(
    base: Request, n: int, progress: Mapping[int, tuple[Sequence[int], bool]] | None = None
) -> list[Request]:
    """The core requests of an `n`-sample request whose first sample is `base` (with the
    client's id and seed): sample i draws with seed + i.

    New (no `progress`): samples 1.. fork from sample 0's computed prompt. Resumed:
    `progress` maps a sample index to (outputs so far, finished); each sample that has not
    ended runs again with its outputs (its KV is recomputed, its next draw is at the same
    position with the same seed as before), without forks, since each one's prompt blocks
    come from the prefix cache. Samples the outputs already end are left out (see
    `ended_samples`)."""
    if progress and max(progress) >= n:
        raise ValueError(f"progress names sample {max(progress)} but the request has n={n}")
    leader_id = sample_request_id(base.request_id, 0, n)
    samples = []
    for i in range(n):
        outputs, finished = (progress or {}).get(i, ((), False))
        if finished or finish_reason(base, outputs) is not None:
            continue
        samples.append(
            dataclasses.replace(
                base,
                request_id=sample_request_id(base.request_id, i, n),
                sampling=dataclasses.replace(
                    base.sampling, seed=(base.sampling.seed + i) % SEED_MODULUS
                ),
                prompt_token_ids=list(base.prompt_token_ids),
                output_token_ids=list(outputs),
                block_ids=[],
                fork_of=leader_id if i > 0 and not progress else None,
            )
        )
    return samples


def ended_samples(
    base: Request, progress: Mapping[int, tuple[Sequence[int], bool]]
) -> list[tuple[int, FinishReason]]:
    """Resumed samples not marked finished whose outputs already end them (the router lost
    their last message): each gets its final message at once instead of running."""
    return [
        (i, reason)
        for i, (outputs, finished) in sorted(progress.items())
        if not finished and (reason := finish_reason(base, outputs)) is not None
    ]
