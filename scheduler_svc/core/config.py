"""The scheduler core's configuration, its statistics, and the error for requests too big."""

from __future__ import annotations

from dataclasses import dataclass

from pagemesh.runtime.speculative_config import SpeculativeConfig
from protos.step import PoolingInfo
from scheduler_svc.core.policy import POLICIES

PREEMPTION_MODES = ("recompute", "swap")
# The scheduler service's --preemption-mode default (pagemesh.runtime.service_flags_scheduler; a
# test checks they agree): swap measured faster than recompute (`python -m bench.scheduling`).
DEFAULT_PREEMPTION_MODE = "swap"


def default_preemption_mode(num_swap_blocks: int) -> str:
    """The default, where there is swap space to use; recompute where there is none, as the
    service falls back when its workers have no swap space."""
    return DEFAULT_PREEMPTION_MODE if num_swap_blocks > 0 else "recompute"


class CapacityError(ValueError):
    """The request can never fit this engine group's KV cache, however long it waits."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes are in blocks (`num_blocks`, `num_swap_blocks`) or tokens (the rest)."""

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Largest prefill chunk of one request in one step (0 = only the step's budget limits
    # it), so that decodes keep flowing while a long prompt streams in. Needs chunked prefill.
    long_prefill_token_threshold: int = 0
    # Reuse the KV of full blocks whose tokens (and all tokens before them) were seen before.
    enable_prefix_caching: bool = True
    # "fcfs" (arrival order) or "priority" (Request.priority, lower first, then arrival).
    policy: str = "fcfs"
    # What a preempted request loses: "recompute" (its KV) or "swap" (nothing: its KV goes
    # to CPU swap space, and back when it resumes; recompute when swap space is full).
    # None: `default_preemption_mode(num_swap_blocks)`, set before anyone reads it.
    preemption_mode: str | None = None
    # Blocks of CPU swap space the workers hold (0 = none).
    num_swap_blocks: int = 0
    # Steps in flight at once (pipeline stages). The running requests are spread over that
    # many micro-batches, so each stage has work while the others compute.
    num_microbatches: int = 1
    # Async scheduling (vLLM's): the next step is planned while this one runs. A decode
    # whose previous step is still in flight is scheduled again, assuming the one token
    # that step samples; the workers fill it in themselves (`SchedulerOutput.
    # append_sampled_tokens`), so only an engine group of one rank can do it.
    async_scheduling: bool = False
    # What the model does: an embedding model's requests are pooled (`Request.pooling`);
    # mean and CLS pooling recompute the whole prompt (no prefix-cache hits).
    pooling: PoolingInfo = PoolingInfo()
    # LoRA adapters one step may hold (the workers' slots); 0 = LoRA off.
    max_loras: int = 0
    # Speculative decoding (core/spec_decode.py); None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode is None:  # frozen: set once here, as if given
            object.__setattr__(
                self, "preemption_mode", default_preemption_mode(self.num_swap_blocks)
            )
        for name in (
            "num_blocks",
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "num_microbatches",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_prefill_token_threshold", "num_swap_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.async_scheduling and self.num_microbatches > 1:
            raise ValueError("async_scheduling needs num_microbatches 1 (a group of one rank)")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError(
                "async scheduling is off while speculating: a step planned "
                "ahead would assume one token, and a verified step adds up to "
                f"{self.speculative.num_speculative_tokens + 1}"
            )
        if self.speculative is not None:
            self._check_speculative(self.speculative.num_speculative_tokens)
        if self.preemption_mode == "swap" and self.num_swap_blocks == 0:
            raise ValueError("preemption_mode 'swap' needs num_swap_blocks > 0")

    def _check_speculative(self, num_drafts: int) -> None:
        """A decode and its drafts go in one step, and their KV in the request's blocks and
        the blocks after (lookahead slots span blocks, so the block size sets no bound)."""
        if num_drafts + 1 > self.max_num_batched_tokens:
            raise ValueError(
                f"num_speculative_tokens {num_drafts} does not fit a step: a "
                f"decode and its drafts are {num_drafts + 1} tokens, and "
                f"max_num_batched_tokens is {self.max_num_batched_tokens}"
            )
        lookahead_blocks = -(-(num_drafts + 1) // self.block_size) + 1
        if num_drafts >= self.max_model_len or lookahead_blocks > self.num_blocks:
            raise ValueError(
                f"num_speculative_tokens {num_drafts} is more than the context "
                f"({self.max_model_len} tokens) or the KV cache ({self.num_blocks} "
                f"blocks of {self.block_size}) can hold for one request"
            )


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int  # includes preempted and swapped requests
    num_free_blocks: int  # device blocks no request holds, cached ones included
    num_blocks: int
    num_preemptions: int  # swapped out or recomputed, since start
    num_swap_outs: int = 0  # of those preemptions, the ones whose KV went to swap space
    num_swap_ins: int = 0  # swapped requests whose KV came back (not recomputed)
    num_swapped: int = 0  # waiting requests whose KV is in swap space
    num_free_swap_blocks: int = 0
    num_cached_blocks: int = 0  # device blocks the prefix cache can hand out, used or free
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV came from the cache
    prefix_cache_hit_rate: float = 0.0  # hits / queries, 0 before any query
    # Speculative decoding since start: drafts verified (a request's, in one step; mean
    # accepted length = 1 + accepted / drafts), their tokens, and the tokens kept.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # of those, the ones kept
    # Tokens of resumed requests (with output already) computed again here, rather than
    # pulled from another group or found in the prefix cache (the last token not counted).
    num_recomputed_tokens: int = 0
