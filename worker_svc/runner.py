"""The model runner: one step in, one batch through the model, sampled tokens out.

It owns the model, the KV cache tensors and a copy of each running request's tokens and
block table. What runs next is the scheduler's decision; the runner validates a step,
applies it to its request state, and executes it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from worker_svc import sampler
from worker_svc.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from worker_svc.kv_cache import (
    KVCacheSpec,
    allocate_kv_caches,
    allocate_swap_caches,
    move_blocks,
    num_blocks_for_budget,
)
from worker_svc.loader import ModelMetadata, load_model
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.types import (
    CachedRequestData,
    NewRequestData,
    SampledToken,
    SamplingParams,
    StepInput,
    StepOutput,
)

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block
    # KV cache size: `num_blocks` wins when set, else as many blocks as fit the budget.
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    num_blocks: int | None = None
    swap_space_bytes: int = 0  # CPU memory for preempted requests' KV; 0 = no swapping
    max_model_len: int | None = None  # tokens; default: the model's own limit
    attention_backend: str = "auto"  # auto | torch | triton

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")


@dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler and router need to know about this worker's model."""

    model_name: str
    architecture: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int  # tokens
    dtype: str  # "float32", "bfloat16", ...
    num_blocks: int
    num_swap_blocks: int
    block_size: int  # tokens per block
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + output known so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is in the cache
    sampling: SamplingParams


@dataclass(frozen=True)
class _Batch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    sample_rows: list[int]  # flat token row whose hidden state feeds the LM head
    sample_request_ids: list[str]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        metadata: ModelMetadata,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
        num_swap_blocks: int = 0,
    ) -> None:
        self.model = model
        self.metadata = metadata
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend: AttentionBackend = get_attention_backend(attention_backend, self.device)
        self.kv_spec = _kv_cache_spec(model, block_size, metadata.dtype)
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        self.num_swap_blocks = num_swap_blocks
        self.swap_caches = allocate_swap_caches(self.kv_spec, num_swap_blocks, self.device)
        self.requests: dict[str, RequestState] = {}

    @classmethod
    def from_config(cls, config: RunnerConfig) -> ModelRunner:
        """Load the model at `config.model_path` and size the KV cache."""
        model, metadata = load_model(
            config.model_path, dtype=config.dtype, device=config.device,
            max_model_len=config.max_model_len,
        )
        spec = _kv_cache_spec(model, config.block_size, metadata.dtype)
        num_blocks = num_blocks_for_budget(spec, config.kv_cache_memory_bytes, config.num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%d bytes each)",
                    num_blocks, config.block_size, spec.bytes_per_block)
        num_swap_blocks = config.swap_space_bytes // spec.bytes_per_block
        return cls(
            model, metadata, num_blocks=num_blocks, block_size=config.block_size,
            device=config.device, attention_backend=config.attention_backend,
            num_swap_blocks=num_swap_blocks,
        )

    def info(self) -> RunnerInfo:
        config = self.model.config
        return RunnerInfo(
            model_name=self.metadata.name,
            architecture=self.metadata.architecture,
            vocab_size=self.metadata.vocab_size,
            eos_token_ids=self.metadata.eos_token_ids,
            max_model_len=self.metadata.max_model_len,
            dtype=str(self.metadata.dtype).removeprefix("torch."),
            num_blocks=self.num_blocks,
            num_swap_blocks=self.num_swap_blocks,
            block_size=self.block_size,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        )

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> StepOutput:
        """Apply the step's request changes, run one forward over every scheduled token,
        and sample for each request whose known tokens are now all computed.

        Raises ValueError (and changes nothing) if the step does not fit the runner's state.
        """
        validate_step(
            step, self.requests, num_blocks=self.num_blocks, block_size=self.block_size,
            max_model_len=self.metadata.max_model_len, vocab_size=self.metadata.vocab_size,
        )
        _check_block_moves(step, self.num_blocks, self.num_swap_blocks)
        move_blocks(self.kv_caches, self.swap_caches, step.blocks_to_swap_out)
        move_blocks(self.swap_caches, self.kv_caches, step.blocks_to_swap_in)
        move_blocks(self.kv_caches, self.kv_caches, step.blocks_to_copy)
        self._update_states(step)
        if not step.num_scheduled_tokens:
            return StepOutput(step_id=step.step_id)
        start_s = time.perf_counter()
        batch = self._build_batch(step.num_scheduled_tokens)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches,
                            batch.metadata, self.backend)
        sampled: dict[str, SampledToken] = {}
        if batch.sample_rows:
            rows = torch.tensor(batch.sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            sampled = self._sample(logits, batch.sample_request_ids)
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        forward_time_ms = (time.perf_counter() - start_s) * 1000.0
        return StepOutput(step_id=step.step_id, sampled=sampled, forward_time_ms=forward_time_ms)

    def _update_states(self, step: StepInput) -> None:
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            # Sent in full: replaces any state kept under the same id (a rebuild).
            self.requests[new.request_id] = RequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
            )
        for cached in step.cached_requests:
            state = self.requests[cached.request_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            # The scheduler's count is authoritative (it may have rolled back on preemption).
            state.num_computed_tokens = cached.num_computed_tokens

    def _build_batch(self, num_scheduled_tokens: dict[str, int]) -> _Batch:
        input_ids, positions, slots = [], [], []
        seq_lens, query_start_loc = [], [0]
        block_rows: list[list[int]] = []
        sample_rows, sample_request_ids = [], []
        for request_id, num_tokens in num_scheduled_tokens.items():
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            token_positions = np.arange(start, end)
            block_ids = np.asarray(state.block_ids, dtype=np.int64)
            input_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
            positions.append(token_positions)
            slots.append(block_ids[token_positions // self.block_size] * self.block_size
                         + token_positions % self.block_size)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + num_tokens)
            block_rows.append(state.block_ids[: -(-end // self.block_size)])
            if end == len(state.token_ids):
                sample_rows.append(query_start_loc[-1] - 1)
                sample_request_ids.append(request_id)
        max_blocks = max(len(row) for row in block_rows)
        block_tables = np.zeros((len(block_rows), max_blocks), dtype=np.int32)
        for i, row in enumerate(block_rows):
            block_tables[i, : len(row)] = row

        def to_device(array: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.asarray(array), dtype=dtype).to(self.device)

        metadata = AttentionMetadata(
            slot_mapping=to_device(np.concatenate(slots), torch.int64),
            block_tables=to_device(block_tables, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            query_start_loc=to_device(query_start_loc, torch.int32),
        )
        return _Batch(
            input_ids=to_device(np.concatenate(input_ids), torch.int64),
            positions=to_device(np.concatenate(positions), torch.int64),
            metadata=metadata,
            sample_rows=sample_rows,
            sample_request_ids=sample_request_ids,
        )

    def _sample(self, logits: torch.Tensor, request_ids: list[str]) -> dict[str, SampledToken]:
        requests = []
        for request_id in request_ids:
            state = self.requests[request_id]
            requests.append(
                sampler.SamplingRequest(state.sampling, state.token_ids, state.num_prompt_tokens)
            )
        tokens = sampler.sample(logits, requests)
        return dict(zip(request_ids, tokens, strict=True))


def _kv_cache_spec(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    config = model.config
    return KVCacheSpec(
        num_layers=config.num_layers,
        block_size=block_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )


def validate_step(
    step: StepInput,
    requests: dict[str, RequestState],
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    vocab_size: int,
) -> None:
    """Raise ValueError if `step` does not fit `requests`; reads, never writes, the state.

    Checks the step as it will be applied: finished ids dropped first, then new requests
    added (replacing any same id), then cached ones extended.
    """
    finished = set(step.finished_request_ids)
    shapes = {
        request_id: _Shape(len(state.token_ids), len(state.block_ids), state.num_computed_tokens)
        for request_id, state in requests.items()
        if request_id not in finished
    }
    new_ids = {new.request_id for new in step.new_requests}
    if len(new_ids) != len(step.new_requests):
        raise ValueError("a request id appears twice among new requests")
    for new in step.new_requests:
        shapes[new.request_id] = _new_request_shape(new, num_blocks, vocab_size)
    cached_ids: set[str] = set()
    for cached in step.cached_requests:
        request_id = cached.request_id
        if request_id in new_ids or request_id in cached_ids:
            raise ValueError(f"request {request_id!r} is listed twice in one step")
        if request_id not in shapes:
            raise ValueError(f"unknown request {request_id!r} in cached requests")
        cached_ids.add(request_id)
        shapes[request_id] = _cached_request_shape(cached, shapes[request_id], num_blocks, vocab_size)
    for request_id, num_tokens in step.num_scheduled_tokens.items():
        if request_id not in shapes:
            raise ValueError(f"unknown request {request_id!r} scheduled")
        _check_scheduled(request_id, num_tokens, shapes[request_id], block_size, max_model_len)


def _check_block_moves(step: StepInput, num_blocks: int, num_swap_blocks: int) -> None:
    """Raise ValueError if a block move names a block outside the device cache or swap space."""
    for name, pairs, src_limit, dst_limit in (
        ("swap-out", step.blocks_to_swap_out, num_blocks, num_swap_blocks),
        ("swap-in", step.blocks_to_swap_in, num_swap_blocks, num_blocks),
        ("copy", step.blocks_to_copy, num_blocks, num_blocks),
    ):
        for src, dst in pairs:
            if not (0 <= src < src_limit and 0 <= dst < dst_limit):
                raise ValueError(f"{name} of block {src} -> {dst} is outside the cache "
                                 f"({num_blocks} device blocks, {num_swap_blocks} swap blocks)")


@dataclass(frozen=True)
class _Shape:
    """A request's sizes once the step's updates are applied."""

    num_known_tokens: int
    num_blocks_held: int
    num_computed_tokens: int


def _check_block_ids(request_id: str, block_ids: list[int], num_blocks: int) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"request {request_id!r}: block ids {bad[:5]} outside 0..{num_blocks - 1}")


def _new_request_shape(new: NewRequestData, num_blocks: int, vocab_size: int) -> _Shape:
    request_id, num_known = new.request_id, len(new.token_ids)
    if not 0 < new.num_prompt_tokens <= num_known:
        raise ValueError(f"request {request_id!r}: num_prompt_tokens "
                         f"{new.num_prompt_tokens} not in 1..{num_known}")
    if not 0 <= new.num_computed_tokens <= num_known:
        raise ValueError(f"request {request_id!r}: num_computed_tokens "
                         f"{new.num_computed_tokens} not in 0..{num_known}")
    # An out-of-range id would index past the embedding (a device assert on CUDA).
    if any(not 0 <= t < vocab_size for t in new.token_ids):
        raise ValueError(f"request {request_id!r}: token id outside 0..{vocab_size - 1}")
    _check_block_ids(request_id, new.block_ids, num_blocks)
    return _Shape(num_known, len(new.block_ids), new.num_computed_tokens)


def _cached_request_shape(cached: CachedRequestData, shape: _Shape, num_blocks: int,
                          vocab_size: int) -> _Shape:
    _check_block_ids(cached.request_id, cached.new_block_ids, num_blocks)
    if any(not 0 <= t < vocab_size for t in cached.new_token_ids):
        raise ValueError(f"request {cached.request_id!r}: new token id outside 0..{vocab_size - 1}")
    num_known = shape.num_known_tokens + len(cached.new_token_ids)
    if not 0 <= cached.num_computed_tokens <= num_known:
        raise ValueError(f"request {cached.request_id!r}: num_computed_tokens "
                         f"{cached.num_computed_tokens} not in 0..{num_known}")
    return _Shape(num_known, shape.num_blocks_held + len(cached.new_block_ids),
                  cached.num_computed_tokens)


def _check_scheduled(
    request_id: str, num_tokens: int, shape: _Shape, block_size: int, max_model_len: int
) -> None:
    end = shape.num_computed_tokens + num_tokens
    if num_tokens < 1:
        raise ValueError(f"request {request_id!r}: {num_tokens} tokens scheduled (need >= 1)")
    if end > shape.num_known_tokens:
        raise ValueError(f"request {request_id!r}: {num_tokens} tokens scheduled from "
                         f"{shape.num_computed_tokens} but only {shape.num_known_tokens} "
                         "tokens are known")
    if end > max_model_len:
        raise ValueError(f"request {request_id!r}: {end} tokens exceed max_model_len "
                         f"{max_model_len}")
    if shape.num_blocks_held * block_size < end:
        raise ValueError(f"request {request_id!r}: {shape.num_blocks_held} blocks of "
                         f"{block_size} cannot hold {end} tokens")
