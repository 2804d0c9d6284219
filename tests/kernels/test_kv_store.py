"""The Triton `store_kv` against `kernels.reference.store_kv` (bit-exact: it only copies)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.kv_store import store_kv  # noqa: E402


def random_store(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    key_dtype: torch.dtype,
    cache_dtype: torch.dtype,
):
    generator = torch.Generator().manual_seed(num_tokens)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(key_dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(key_dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(2, *shape, generator=generator).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::3] = -1  # padding tokens are skipped
    return key, value, cache, slots


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,block_size,key_dtype,cache_dtype",
    [
        (2, 64, 8, torch.float32, torch.float32),
        (1, 96, 16, torch.float16, torch.float16),
        (4, 128, 32, torch.bfloat16, torch.bfloat16),
        (3, 24, 128, torch.float32, torch.bfloat16),  # cast on store; odd head count and dim
    ],
)
def test_store_matches_reference(num_kv_heads, head_dim, block_size, key_dtype, cache_dtype):
    key, value, cache, slots = random_store(
        13, num_kv_heads, head_dim, block_size, 4, key_dtype, cache_dtype
    )
    expected = cache.clone()
    reference.store_kv(key, value, expected[0], expected[1], slots)
    store_kv(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


def test_strided_key_from_a_fused_projection():
    """K and V come out of one qkv projection as views with a token stride > heads * dim."""
    key, value, cache, slots = random_store(6, 2, 64, 8, 2, torch.float32, torch.float32)
    fused = torch.cat([key, value], dim=1)  # [tokens, 4, 64]
    expected = cache.clone()
    reference.store_kv(key, value, expected[0], expected[1], slots.to(torch.int32))
    store_kv(fused[:, :2], fused[:, 2:], cache[0], cache[1], slots.to(torch.int32))
    assert torch.equal(cache, expected)


def test_no_tokens_is_a_no_op():
    key, value, cache, slots = random_store(0, 2, 64, 8, 2, torch.float32, torch.float32)
    before = cache.clone()
    store_kv(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, before)


def test_wrapper_rejects_bad_arguments():
    key, value, cache, slots = random_store(4, 2, 64, 8, 2, torch.float32, torch.float32)
    k_cache, v_cache = cache[0], cache[1]
    bad_calls = {
        "do not fit a cache": (key[:, :1], value[:, :1], k_cache, v_cache, slots),
        "slot_mapping must be": (key, value, k_cache, v_cache, slots.float()),
        "slot_mapping must be int32/int64 \\[4\\]": (key, value, k_cache, v_cache, slots[:3]),
        "share strides and dtype": (key, value, k_cache, v_cache.half(), slots),
        "contiguous in head_dim": (
            key.transpose(1, 2).contiguous().transpose(1, 2),
            value,
            k_cache,
            v_cache,
            slots,
        ),
        "is not one of": (key.double(), value.double(), k_cache, v_cache, slots),
        "num_blocks, block_size": (key, value, k_cache[0], v_cache[0], slots),
    }
    for message, args in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            store_kv(*args)
