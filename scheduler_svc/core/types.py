"""Requests and the step contract of the scheduler core.

Bookkeeping follows vLLM v1: a request has `num_computed_tokens` (tokens whose KV is in the
cache) and `num_tokens` (prompt + output). There is no prefill or decode phase: a step
schedules some number of the request's uncomputed tokens, one for a decode, a chunk for a
prefill.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

RequestId = NewType("RequestId", str)
BlockId = int


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted with its KV copied to CPU swap space
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingSpec:
    """What the workers need to sample a request; opaque to scheduling decisions."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    num_logprobs: int = 0


@dataclass
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    max_tokens: int
    min_tokens: int = 0
    # EOS (unless ignored) and requested stop ids: any of them ends the request once
    # `min_tokens` tokens exist.
    stop_token_ids: frozenset[int] = frozenset()
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

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1")

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


@dataclass(frozen=True)
class NewRequestSchedule:
    """A request the workers do not hold yet (first time, or after a preemption)."""

    request_id: RequestId
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[BlockId]
    num_computed_tokens: int
    sampling: SamplingSpec
    min_tokens: int
    stop_token_ids: frozenset[int]


@dataclass(frozen=True)
class CachedRequestSchedule:
    """A request the workers hold: only the blocks and tokens added since they last saw it."""

    request_id: RequestId
    new_block_ids: list[BlockId]
    num_computed_tokens: int
    # Tokens sampled since the workers last heard of the request (usually one).
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    step_id: int
    new_requests: list[NewRequestSchedule] = field(default_factory=list)
    cached_requests: list[CachedRequestSchedule] = field(default_factory=list)
    # request id -> tokens computed this step
    num_scheduled_tokens: dict[RequestId, int] = field(default_factory=dict)
    # Requests the workers must forget before this step (finished, aborted, preempted).
    finished_request_ids: list[RequestId] = field(default_factory=list)
    # KV block moves the workers apply before this step's forward, in this order:
    # (device block, swap block) copies to CPU, (swap block, device block) copies back,
    # then (source, destination) device copies (a fork's private copy of its leader's block
    # holding the last prompt token).
    blocks_to_swap_out: list[tuple[BlockId, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, BlockId]] = field(default_factory=list)
    blocks_to_copy: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    # The workers append each token they sample to the request themselves, and
    # `new_token_ids` carry none of those (async scheduling, a group of one rank).
    append_sampled_tokens: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not (self.num_scheduled_tokens or self.finished_request_ids
                    or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float = 0.0
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class StepResult:
    """What the workers returned for one step."""

    step_id: int
    sampled: dict[RequestId, SampledToken] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestEvent:
    """New tokens of one request, and its end when it finished this step."""

    request_id: RequestId
    new_tokens: tuple[SampledToken, ...] = ()
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
