"""Requests of the scheduler core (the step contract itself is `protos.step`).

Bookkeeping follows vLLM v1: a request has `num_computed_tokens` (tokens whose KV is in the
cache) and `num_tokens` (prompt + output). There is no prefill or decode phase: a step
schedules some number of the request's uncomputed tokens, one for a decode, a chunk for a
prefill.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protos.step import (
    BlockId,
    ImageInput,
    LoraRef,
    PoolingParams,
    RequestId,
    SampledToken,
    SamplingParams,
)


@dataclass(frozen=True)
class HeldKV:
    """Blocks holding the KV of `token_ids` (a request's prompt + output, from the first),
    in block-table order: the last one may be partly filled."""

    request_id: RequestId
    block_ids: tuple[BlockId, ...]
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVImport:
    """An importing request's blocks to fill: block-table indices `first_index` onwards are
    `block_ids` (the ones before are prefix-cache hits); `num_tokens` tokens' KV in all."""

    request_id: RequestId
    num_tokens: int
    first_index: int
    block_ids: tuple[BlockId, ...]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted with its KV copied to CPU swap space
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    # Ended here unfinished, its KV held for the group that continues it (core/kv_moves.py).
    HANDED_OFF = "handed_off"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.HANDED_OFF,
}


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    # With min_tokens and the stop ids (EOS unless ignored, and the client's): any of them
    # ends the request once `min_tokens` tokens exist.
    sampling: SamplingParams
    max_tokens: int
    arrival_time_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[BlockId] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Lower value = more important (vLLM's convention); used by the priority policy.
    priority: int = 0
    # n > 1: the request whose computed prompt this one forks from (shares its full blocks,
    # copies its partly filled last block); None for ordinary requests and group leaders.
    fork_of: RequestId | None = None
    # How many of `all_token_ids` the workers hold; the rest travel in the next step's diff.
    # With async scheduling it counts the tokens steps in flight will sample too.
    num_tokens_on_workers: int = 0
    # Tokens that steps in flight will sample for it (async scheduling: up to 2), not known yet.
    num_pending_tokens: int = 0
    # An embedding request: its prompt is pooled into one vector (the step that completes
    # the prompt returns it instead of a token) and it ends there.
    pooling: PoolingParams | None = None
    # A vision-language prompt's images, each over its placeholder tokens; their content is
    # part of the block hashes (two prompts with different images never share KV).
    images: tuple[ImageInput, ...] = ()
    # The LoRA adapter it runs with (None: the base model): its name is part of the block
    # hashes (two adapters never share KV), and a step holds at most max_loras adapters.
    lora: LoraRef | None = None
    # Speculative decoding: the drafts its step in flight verifies (computed after its
    # last token, rolled back past the first rejected one), and its totals so far.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Disaggregated prefill: the request's own max_tokens while `max_tokens` is cut short so
    # that it stops after its first token and hands its KV off (0: it runs to its end here).
    hand_off_below: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1")

    @property
    def min_tokens(self) -> int:
        return self.sampling.min_tokens

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.sampling.stop_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}
# The same table read the other way: the status a request ends in for a reason.
FINISHED_STATUS = {reason: status for status, reason in _FINISH_REASONS.items()}


@dataclass(frozen=True)
class RequestEvent:
    """New tokens of one request, and its end when it finished this step."""

    request_id: RequestId
    new_tokens: tuple[SampledToken, ...] = ()
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    embedding: bytes | None = None  # an embedding request's vector (float32 LE), at its end
    # Speculative decoding: the drafts this step verified for it, and how many it kept.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # It ended here unfinished, its KV held for the group that continues it.
    handoff: HeldKV | None = None

    @property
    def ends_stream(self) -> bool:
        """Its last event here: finished, or handed off to another group."""
        return self.finish_reason is not None or self.handoff is not None
