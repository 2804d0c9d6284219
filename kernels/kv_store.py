"""Triton kernel: write this step's keys and values into the paged KV cache.

Same signature and semantics as `kernels.reference.store_kv`. Layout: key/value
`[num_tokens, num_kv_heads, head_dim]`; k_cache/v_cache `[num_blocks, block_size,
num_kv_heads, head_dim]` (the two halves of one layer's `[2, ...]` cache); token `t` goes
to slot `slot_mapping[t] = block_id * block_size + offset`, and slot -1 skips the token
(padding). One program per token moves all of its kv heads at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import FLOAT_DTYPES, check_on_kernel_device


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # int64 slot: a large cache's element offsets pass 2**31.
    cache_offsets = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_token
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    tl.store(v_cache_ptr + cache_offsets, value, mask=mask)


def check_store_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments fit the kernel (see the module docstring)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must "
            "both be [num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share strides and dtype (halves of one cache)")
    _, _, num_kv_heads, head_dim = k_cache.shape
    if key.dim() != 3 or key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit a cache "
            f"of {num_kv_heads} kv heads x {head_dim}"
        )
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"slot_mapping must be int32/int64 [{key.shape[0]}], got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    for name, tensor in {"key": key, "value": value, "k_cache": k_cache}.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype {tensor.dtype} is not one of {FLOAT_DTYPES}")
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, strides {tensor.stride()}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_on_kernel_device(key.device, _store_kv_kernel)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their slots (cast to the
    cache dtype first if they differ); slot -1 means "do not store". Slots past the cache
    are not checked (that would cost a device sync): the runner validates block ids first."""
    check_store_kv_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        # Cast with torch (round to nearest even): Triton's interpreter truncates fp32 -> bf16,
        # so an in-kernel cast would differ from the reference there. The runner's K/V are
        # already in the cache dtype; this copy is for other callers.
        key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
