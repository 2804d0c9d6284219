"""The fused elementwise C kernels (kernels/cpu_fused.py) against their torch references:
the same values (bitwise where the kernel rounds op by op as torch does), in fp32 and bf16,
at sizes below and above the kernels' threshold for using threads, and at every x86-64 ISA
level this CPU can run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import cpu_fused, cpu_native, reference
from tests.worker_svc.test_cpu_native_builds import (
    X86_LEVELS,
    _skip_unless_runnable,
    _skip_unless_x86,
    needs_compiler,
)

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 64), (3, 100), (70, 576)]  # 70 x 576 is past the single-thread threshold


def _close(dtype: torch.dtype) -> dict:
    # A norm's sum of squares (and SiLU's exp) differ from torch's in the last fp32 bit,
    # which can move a bf16 result by one step.
    return {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}


def _norm_case(rows: int, width: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g).to(dtype)
    residual = torch.randn(rows, width, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    return x, residual, weight


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SHAPES)
def test_add_rms_norm_matches_the_reference_and_adds_in_place(dtype, rows, width):
    x, residual, weight = _norm_case(rows, width, dtype)
    expected, expected_sum = cpu_fused.add_rms_norm_reference(x, residual, weight, 1e-5)
    kept = residual.clone()
    out, summed = cpu_fused.add_rms_norm(x, residual, weight, 1e-5)
    assert summed is residual and not torch.equal(residual, kept)  # the C kernel ran
    assert torch.equal(summed, expected_sum)  # one add, rounded once: exact
    torch.testing.assert_close(out, expected, **_close(dtype))
    plain, same = cpu_fused.add_rms_norm(x, None, weight, 1e-5)
    assert same is x
    torch.testing.assert_close(
        plain, cpu_fused.add_rms_norm_reference(x, None, weight, 1e-5)[0], **_close(dtype)
    )


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_rotary_in_place_on_a_qkv_view_equals_the_reference_bitwise(dtype, num_tokens):
    heads, kv_heads, head_dim, max_pos = 6, 2, 64, 4096
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2)
    cos = torch.cat((angles, angles), dim=-1).cos()
    sin = torch.cat((angles, angles), dim=-1).sin()
    expected = qkv.clone()
    for tensor in (expected, qkv):
        q, k, _ = tensor.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k = q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
        rotate = cpu_fused.rotary_reference_ if tensor is expected else cpu_fused.rotary_
        rotate(q, positions, cos, sin)
        rotate(k, positions, cos, sin)
    assert torch.equal(qkv, expected)  # v untouched in both, q and k alike to the bit
    bad = positions.clone()
    bad[-1] = max_pos
    with pytest.raises(ValueError, match="outside the tables"):
        cpu_fused.rotary_(
            qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim), bad, cos, sin
        )


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SHAPES)
def test_silu_mul_matches_the_reference(dtype, rows, width):
    gate_up = (3 * torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(2))).to(
        dtype
    )
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # past exp's clamp, and zeros
    torch.testing.assert_close(
        cpu_fused.silu_mul(gate_up), cpu_fused.silu_mul_reference(gate_up), **_close(dtype)
    )


def test_what_no_kernel_covers_takes_the_reference():
    x, residual, weight = _norm_case(4, 32, torch.float16)
    kept = residual.clone()
    out, summed = cpu_fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, kept)  # fp16 has no kernel: nothing written in place
    assert torch.equal(out, cpu_fused.add_rms_norm_reference(x, kept, weight, 1e-6)[0])
    gate_up = torch.randn(3, 8, dtype=torch.float16)
    assert torch.equal(cpu_fused.silu_mul(gate_up), cpu_fused.silu_mul_reference(gate_up))


@needs_compiler
@pytest.mark.parametrize("level", list(X86_LEVELS))
def test_each_isa_level_of_the_fused_kernels_matches_the_reference(level, tmp_path):
    _skip_unless_x86()
    config = dataclasses.replace(cpu_native.current_config(), cache_dir=tmp_path)
    arch = (f"-march={level}",)
    libs = {
        name: cpu_native._build(name, arch, config)
        for name in (
            "cpu_rmsnorm",
            "cpu_rotary",
            "cpu_silu_mul",
            "cpu_store_kv",
            "cpu_argmax",
            "cpu_token_mask",
        )
    }
    _skip_unless_runnable(level)
    for dtype in DTYPES:
        x, residual, weight = _norm_case(70, 576, dtype, seed=4)
        expected = cpu_fused.add_rms_norm_reference(x, residual, weight, 1e-5)[0]
        out = cpu_fused.add_rms_norm(x, residual, weight, 1e-5, lib=libs["cpu_rmsnorm"])[0]
        torch.testing.assert_close(out, expected, **_close(dtype))
        q = torch.randn(9, 3, 32).to(dtype)
        positions = torch.arange(9)
        cos, sin = torch.rand(16, 32), torch.rand(16, 32)
        expected_q = q.clone()
        cpu_fused.rotary_reference_(expected_q, positions, cos, sin)
        cpu_fused.rotary_(q, positions, cos, sin, lib=libs["cpu_rotary"])
        assert torch.equal(q, expected_q)
        k, v = torch.randn(5, 2, 32).to(dtype), torch.randn(5, 2, 32).to(dtype)
        caches = [torch.zeros(4, 4, 2, 32, dtype=dtype) for _ in range(4)]
        slots = torch.tensor([3, 0, 15, -1, 7])
        reference.store_kv(k, v, caches[0], caches[1], slots)
        cpu_fused.store_kv(k, v, caches[2], caches[3], slots, lib=libs["cpu_store_kv"])
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        logits = torch.randn(9, 1000)
        logits[0, 3:] = 9.0
        assert torch.equal(cpu_fused.argmax(logits, lib=libs["cpu_argmax"]), logits.argmax(-1))
        bits = torch.randint(-(2**31), 2**31 - 1, (4, 32), dtype=torch.int32)
        masked, expected_masked = logits.clone(), logits.clone()
        cpu_fused.apply_token_bitmask_reference_(expected_masked, [0, 2, 5, 8], bits)
        cpu_fused.apply_token_bitmask_(masked, [0, 2, 5, 8], bits, lib=libs["cpu_token_mask"])
        assert torch.equal(masked, expected_masked)
        assert torch.equal(
            cpu_fused.argmax_masked(logits, [0, 2, 5, 8], bits, lib=libs["cpu_token_mask"]),
            expected_masked[[0, 2, 5, 8]].argmax(-1),
        )
        gate_up = torch.randn(70, 1152).to(dtype)
        torch.testing.assert_close(
            cpu_fused.silu_mul(gate_up, lib=libs["cpu_silu_mul"]),
            cpu_fused.silu_mul_reference(gate_up),
            **_close(dtype),
        )


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [3, 700])  # 700 rows use the threads
def test_store_kv_from_qkv_views_equals_the_reference(dtype, num_tokens):
    heads, kv_heads, head_dim, num_blocks, block_size = 6, 2, 64, 64, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    k, v = k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[1] = -1  # padding: not stored
    caches = [
        torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(4)
    ]
    reference.store_kv(k, v, caches[0], caches[1], slots)
    cpu_fused.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].any()
    slots[0] = num_blocks * block_size
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_fused.store_kv(k, v, caches[2], caches[3], slots)


@needs_compiler
@pytest.mark.parametrize("vocab", [1, 7, 49152])
def test_argmax_is_torchs_first_maximum(vocab):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(70, vocab, generator=g)
    logits[1] = 0.5  # a whole row tied: the first index
    logits[2] = float("-inf")
    if vocab > 3:
        logits[3, 2:] = logits[3].max() + 1  # ties between lanes and in the tail
        logits[4, vocab // 2] = float("nan")  # NaN beats everything, as in torch
        logits[4, vocab - 1] = float("nan")
        logits[5] = -logits[5].abs() - 1  # every value negative
        logits[6] = -logits[6].abs()
        logits[6, vocab // 3], logits[6, vocab - 2] = -0.0, 0.0  # signed zeros tie
        logits[7, 1], logits[7, vocab - 1] = float("inf"), float("inf")
        logits[8, vocab - 2] = -float("nan")  # a NaN with its sign bit set
        logits[9] = -0.0
    assert torch.equal(cpu_fused.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(cpu_fused.argmax(logits[::3]), logits[::3].argmax(dim=-1))  # strided


@needs_compiler
@pytest.mark.parametrize("vocab,words", [(509, 16), (49152, 1536), (1000, 30)])
def test_token_bitmask_equals_the_reference(vocab, words):
    """Structured output's mask: every token whose bit is clear, and every token past the
    mask's words (1000 > 30 * 32), becomes -inf in the chosen rows only; a word of all
    ones or all zeros (the kernel's shortcuts) too."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(70, vocab, generator=g)
    bits = torch.randint(-(2**31), 2**31 - 1, (64, words), dtype=torch.int32, generator=g)
    bits[0], bits[1] = -1, 0
    bits[2] = 0
    bits[2, 3] = -(2**31)  # only bit 31 of one word: the sign bit
    rows = list(range(3, 67))  # past the threads' threshold at 49152
    expected, masked = logits.clone(), logits.clone()
    cpu_fused.apply_token_bitmask_reference_(expected, rows, bits)
    cpu_fused.apply_token_bitmask_(masked, rows, bits)
    assert torch.equal(masked, expected)
    assert torch.equal(masked[:3], logits[:3]) and torch.equal(masked[67:], logits[67:])
    kept = ~torch.isinf(expected[rows[2]])
    assert kept.sum() == 1 and kept[3 * 32 + 31]  # the sign bit's token, alone
    assert (
        torch.isinf(expected[rows[1]]).all()
        and not torch.isinf(expected[rows[0]][: 32 * words]).any()
    )


@needs_compiler
@pytest.mark.parametrize("vocab,words", [(509, 16), (49152, 1536), (1000, 30), (40, 2)])
def test_masked_argmax_is_the_argmax_of_the_masked_logits(vocab, words):
    """Without copying the logits: ties to the first index, the first allowed NaN, a row with
    nothing allowed (0, as torch's argmax of all -inf), words all ones or all zeros, and
    allowed bits past the vocabulary (40 < 2 * 32) never chosen."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(70, vocab, generator=g)
    bits = torch.randint(-(2**31), 2**31 - 1, (64, words), dtype=torch.int32, generator=g)
    bits[0], bits[1] = -1, 0
    rows = list(range(3, 67))
    logits[rows[2]] = 0.25  # a whole row tied
    logits[rows[3], 5:] = float("nan")
    logits[rows[4], :] = float("-inf")
    logits[rows[5], min(vocab, 32 * words) - 1] = 1e9  # the last allowed column, if allowed
    if vocab < 32 * words:
        bits[6, -1] = -1  # bits beyond the vocabulary set
    original = logits.clone()
    masked = logits.clone()
    cpu_fused.apply_token_bitmask_reference_(masked, rows, bits)
    assert torch.equal(cpu_fused.argmax_masked(logits, rows, bits), masked[rows].argmax(dim=-1))
    torch.testing.assert_close(logits, original, rtol=0, atol=0, equal_nan=True)  # unchanged
