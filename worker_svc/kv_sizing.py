"""A rank's KV cache budget from its model and config (the rules are worker_svc/kv_budget.py):
as given, or on CUDA what is free after one forward pass as large as a step gets
(`profile_forward`), or on CPU a share of the host's available memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker_svc.attention import AttentionMetadata, get_attention_backend
from worker_svc.kv_budget import KVBudget, cpu_budget, cuda_budget, explicit_budget
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_caches
from worker_svc.loader import ModelMetadata
from worker_svc.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from worker_svc.runner_config import RunnerConfig


def rank_kv_budget(
    config: RunnerConfig, model: LlamaForCausalLM, metadata: ModelMetadata, spec: KVCacheSpec
) -> KVBudget:
    """What this rank's KV cache may take, and why (worker_svc/kv_budget.py)."""
    if config.num_blocks is not None:
        return KVBudget(
            config.num_blocks * spec.bytes_per_block,
            f"--num-kv-blocks {config.num_blocks}, as given",
        )
    if config.kv_cache_memory_bytes is not None:
        return explicit_budget(config.kv_cache_memory_bytes)
    device = torch.device(config.device)
    if device.type == "cuda":
        return cuda_budget(
            device,
            config.gpu_memory_utilization,
            lambda: profile_forward(model, metadata, spec, config),
        )
    return cpu_budget(config.cpu_kv_cache_fraction)


@torch.inference_mode()
def profile_forward(
    model: LlamaForCausalLM, metadata: ModelMetadata, spec: KVCacheSpec, config: RunnerConfig
) -> None:
    """One forward pass as large as a step gets: a single sequence of max_num_batched_tokens
    (capped at max_model_len) tokens over a cache of just its blocks, then the LM head over
    max_num_seqs rows. Every TP rank runs it at once (its collectives pair up)."""
    device = torch.device(config.device)
    num_tokens = min(config.max_num_batched_tokens, metadata.max_model_len)
    num_blocks = -(-num_tokens // config.block_size)
    caches = allocate_kv_caches(spec, num_blocks, device)
    attention = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
    )
    intermediate = None
    if not model.parallel.is_first_stage:
        zeros = torch.zeros(
            num_tokens, model.config.hidden_size, dtype=metadata.dtype, device=device
        )
        intermediate = (zeros, zeros.clone())
    hidden, residual = model(
        torch.zeros(num_tokens, dtype=torch.long, device=device),
        torch.arange(num_tokens, device=device),
        caches,
        attention,
        get_attention_backend(config.attention_backend, device),
        intermediate,
    )
    if model.parallel.is_last_stage and not metadata.pooling.embeds:
        rows = min(config.max_num_seqs, num_tokens)
        model.compute_logits(hidden[:rows], residual[:rows])
