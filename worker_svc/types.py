"""Plain types of one step on a worker: what the runner consumes and returns.

The servicer converts `ExecuteStepRequest` protobufs into these (see `convert.py`);
nothing below this line knows about gRPC.

Token bookkeeping follows vLLM v1: a request's known tokens are
`token_ids = prompt + output so far`; `num_computed_tokens` of them already have KV in
the cache. A step computes `num_scheduled_tokens[request_id]` more tokens starting at
`num_computed_tokens`. When that reaches the end of `token_ids`, the driver rank samples
the next token and returns it; the scheduler sends it back to every rank in the next
step's `CachedRequestData.new_token_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, already validated by the router.

    `temperature == 0` means greedy. `seed` is always set (the scheduler draws one for
    unseeded requests) so that a request's randomness depends only on its seed and the
    index of the token being drawn, never on the batch it shares.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    min_tokens: int = 0
    # Token ids that end the request (EOS unless ignored, plus stop_token_ids); masked
    # while fewer than `min_tokens` tokens have been generated.
    stop_token_ids: tuple[int, ...] = ()
    # How many top alternatives to return per sampled token, with the chosen token's
    # logprob; 0 = neither (what the client gets then carries no logprobs).
    num_logprobs: int = 0


@dataclass
class NewRequestData:
    """A request the worker has not seen (or must rebuild): sent in full once."""

    request_id: str
    token_ids: list[int]  # prompt + any output already generated (on resume)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Tokens appended since the worker last heard of the request (normally the one sampled
    # in its previous step). Every rank learns sampled tokens this way, so pipeline stages
    # that never sample stay in step with the one that does.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepInput:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request_id -> number of tokens to compute this step (>= 1 for every scheduled request)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests the worker must forget before this step runs (finished, aborted, preempted).
    finished_request_ids: list[str] = field(default_factory=list)
    # KV block moves applied before the forward, in this order: (device, swap) copies to
    # CPU swap space, (swap, device) copies back, (source, destination) device copies.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # The driver appends the tokens it samples to each request itself (async scheduling,
    # a group of one rank); `new_token_ids` then carry none of them.
    append_sampled_tokens: bool = False


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    # Of the chosen token under the model's raw distribution; 0.0 (not computed) when the
    # request asked for no logprobs (num_logprobs 0: the client gets none).
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass
class StepOutput:
    step_id: int
    # Only requests whose scheduled tokens reached the end of their known tokens.
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    forward_time_ms: float = 0.0
