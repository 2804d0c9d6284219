"""Checks on arriving requests and on sampled tokens; pure functions of a request."""

from __future__ import annotations

from collections.abc import Container

from scheduler_svc.core.config import CapacityError, SchedulerConfig
from scheduler_svc.core.types import Request, RequestId, RequestStatus


def check_admissible(request: Request, config: SchedulerConfig,
                     live_ids: Container[RequestId]) -> None:
    """Raises ValueError for a request that cannot be queued, CapacityError (a ValueError)
    for one that could never fit the KV cache however long it waited."""
    if request.request_id in live_ids:
        raise ValueError(f"request id {request.request_id!r} is already in flight")
    max_len = request.num_prompt_tokens + request.max_tokens
    if max_len > config.max_model_len:
        raise ValueError(
            f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.max_tokens}) "
            f"exceeds max_model_len ({config.max_model_len})"
        )
    num_blocks = -(-max_len // config.block_size)
    if num_blocks > config.num_blocks:
        raise CapacityError(
            f"request needs up to {num_blocks} KV blocks but the cache has "
            f"{config.num_blocks}; lower max_tokens or shorten the prompt"
        )


def check_group(requests: list[Request]) -> None:
    """n > 1 samples: `requests[0]` leads; the others share its prompt and fork from it."""
    if not requests:
        raise ValueError("empty request group")
    leader, forks = requests[0], requests[1:]
    if leader.fork_of is not None:
        raise ValueError(f"group leader {leader.request_id} must not fork")
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("duplicate request ids in a group")
    for fork in forks:
        if fork.fork_of != leader.request_id:
            raise ValueError(f"request {fork.request_id} must fork from {leader.request_id}")
        if fork.prompt_token_ids != leader.prompt_token_ids:
            raise ValueError(f"request {fork.request_id}: a fork's prompt must be its leader's")


def stop_status(request: Request, token_id: int) -> RequestStatus | None:
    """How the request ends now that `token_id` was appended to its output, or None."""
    num_output = len(request.output_token_ids)
    if token_id in request.stop_token_ids and num_output >= request.min_tokens:
        return RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
