"""The ctypes wrappers of `kernels/cpu_decode.c` (built by `cpu_native.py`): decode attention
(`paged_decode`, one query token per sequence) and a whole batch of decodes and prefills
mixed (`paged_attention`), for CPU tensors in fp32 or bf16 (`available`).

The decode kernel reads K and V in place through the block tables, where the torch path
(`cpu_attention.py`) first gathers every sequence's blocks into a contiguous copy and then
runs SDPA: a W64 decode step measured faster with it in fp32 and far faster in bf16
(`python -m bench.decode_step`, which writes bench/results/decode_step.md). Without a
compiler (or with the kernels disabled) `available()` is False and the torch path is used.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import cpu_native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def available(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES and cpu_native.library() is not None


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    lib: ctypes.CDLL | None = None,
    split_keys: bool = True,
) -> torch.Tensor:
    """One query token per sequence: query [S, H, D] -> [S, H, D], as the reference computes
    for q_len 1. Tensors must be CPU, fp32 or bf16 (`available`). `lib`: another build of
    cpu_decode (`cpu_native._build(arch_flags=...)`), for tests; default the native one.
    `split_keys` False keeps each sequence on one thread (the kernel before the KV split:
    benchmarks)."""
    lib = lib or cpu_native.library()
    if lib is None or query.dtype not in _DTYPES:
        raise RuntimeError("the native decode kernel is not available for this input")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache halves must be contiguous")
    code = lib.paged_decode(
        _DTYPES[query.dtype],
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        float(scale),
        int(sliding_window or 0),
        max(1, torch.get_num_threads()),
        int(split_keys),
    )
    if code:
        raise MemoryError("the native decode kernel could not allocate its scratch memory")
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """A whole batch, decodes and prefills mixed, in one call: query [T, H, D] -> [T, H, D]
    as the reference computes it, every sequence's keys (this step's too) read from the
    cache. Tensors as `paged_decode`'s; `lib` as there."""
    lib = lib or cpu_native.library()
    if lib is None or query.dtype not in _DTYPES:
        raise RuntimeError("the native attention kernel is not available for this input")
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache halves must be contiguous")
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    code = lib.paged_attention(
        _DTYPES[query.dtype],
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        starts.data_ptr(),
        out.data_ptr(),
        lens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        float(scale),
        int(sliding_window or 0),
        max(1, torch.get_num_threads()),
    )
    if code == -2:
        raise ValueError("a sequence has more query tokens than its context")
    if code:
        raise MemoryError("the native attention kernel could not allocate its scratch memory")
    return out
