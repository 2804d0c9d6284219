"""The Triton fused MoE (`kernels.fused_moe_triton`) against `kernels.moe.fused_experts`
(interpreter, CPU tensors), and its align step's invariants.

Tolerances: fp32 1e-5 relative (both sides accumulate in fp32; only the sum order differs).
In bf16/fp16 the reference rounds to the dtype after each linear, the SiLU, the product,
the weighting and each slot's `index_add_`, while the kernel rounds after the gate|up GEMM,
the SiLU-and-mul and the weighted down GEMM and sums the slots in fp32: outputs of magnitude
~1 then differ by a few units in the last place. The interpreter also rounds fp32 -> bf16
toward zero (a GPU rounds to nearest), which biases each of the kernel's three roundings:
measured here, kernel vs reference at most 0.047 on outputs up to 2.6 (the reference is
0.014 from fp64). So bf16 (ulp 2^-7 at 1) is held to 3e-2 and fp16 (ulp 2^-10 at 1, max
difference 0.002 measured) to 4e-3, absolute and relative.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.fused_moe_triton import (  # noqa: E402
    align_pairs,
    choose_tiles,
    fused_experts_triton,
)
from kernels.moe import fused_experts, route  # noqa: E402

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def random_moe(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    intermediate: int,
    dtype: torch.dtype,
    seed: int = 0,
):
    """Weights scaled so every stage's outputs are ~N(0, 1); Qwen-style routing (the
    weights in the hidden dtype, renormalised)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    w13 = (
        torch.randn(num_experts, 2 * intermediate, hidden_size, generator=generator)
        * hidden_size**-0.5
    )
    w2 = (
        torch.randn(num_experts, hidden_size, intermediate, generator=generator)
        * intermediate**-0.5
    )
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    topk_weights, topk_ids = route(logits, top_k, renormalize=True, weights_dtype=dtype)
    return hidden.to(dtype), w13.to(dtype), w2.to(dtype), topk_weights, topk_ids


def assert_matches_reference(hidden, w13, w2, topk_weights, topk_ids) -> None:
    expected = fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    actual = fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids)
    assert actual.dtype == hidden.dtype and actual.shape == hidden.shape
    tolerance = TOLERANCES[hidden.dtype]
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


# (num_tokens, num_experts, top_k, hidden, intermediate): one decode token, fewer tokens
# than a block, batches that fill 64-pair blocks, ragged hidden/intermediate.
SHAPES = [
    (1, 8, 2, 64, 32),
    (7, 3, 2, 48, 48),
    (64, 1, 1, 64, 32),
    (64, 3, 2, 48, 48),
    (64, 8, 1, 96, 80),
    (7, 8, 2, 72, 40),  # neither a multiple of 16
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-K{}-H{}-I{}".format(*s))
def test_fp32_matches_reference(shape):
    assert_matches_reference(*random_moe(*shape, torch.float32, seed=sum(shape)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shape",
    [(7, 3, 2, 48, 48), (64, 3, 2, 64, 32), (64, 8, 2, 72, 40)],
    ids=lambda s: "T{}-E{}-K{}-H{}-I{}".format(*s),
)
def test_half_dtypes_match_reference(shape, dtype):
    assert_matches_reference(*random_moe(*shape, dtype, seed=sum(shape)))


def test_fp32_weights_with_bf16_hidden():
    """Mixtral keeps its routing weights in fp32 whatever the model's dtype."""
    hidden, w13, w2, topk_weights, topk_ids = random_moe(7, 3, 2, 48, 32, torch.bfloat16)
    assert_matches_reference(hidden, w13, w2, topk_weights.float(), topk_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ids_of_other_ranks_contribute_nothing(dtype):
    """-1 (an expert another rank holds) and ids past the last expert are skipped; a token
    whose every slot is elsewhere gets zeros."""
    hidden, w13, w2, topk_weights, topk_ids = random_moe(7, 3, 2, 48, 32, dtype, seed=3)
    topk_ids[0, 1] = -1
    topk_ids[2, 0] = 3
    topk_ids[4] = -1
    assert_matches_reference(hidden, w13, w2, topk_weights, topk_ids.to(torch.int32))
    out = fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids)
    assert torch.equal(out[4], torch.zeros_like(out[4]))


def test_all_ids_elsewhere_gives_zeros():
    hidden, w13, w2, topk_weights, topk_ids = random_moe(5, 3, 2, 48, 32, torch.float32)
    out = fused_experts_triton(hidden, w13, w2, topk_weights, torch.full_like(topk_ids, -1))
    assert torch.equal(out, torch.zeros_like(hidden))


def test_duplicates_and_an_expert_with_no_tokens():
    """Every token on experts 0 and 2 (expert 1 idle), in both slot orders; one token picks
    expert 2 in both slots."""
    hidden, w13, w2, topk_weights, _ = random_moe(7, 3, 2, 48, 32, torch.float32, seed=5)
    topk_ids = torch.tensor([[0, 2], [2, 0]] * 3 + [[2, 2]])
    assert_matches_reference(hidden, w13, w2, topk_weights, topk_ids)


@pytest.mark.parametrize("top_k", [1, 2])
def test_no_tokens(top_k):
    hidden, w13, w2, topk_weights, topk_ids = random_moe(0, 3, top_k, 48, 32, torch.float32)
    out = fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids)
    assert out.shape == (0, 48) and out.dtype == torch.float32


def test_align_pairs_groups_and_pads_each_expert():
    num_experts, block_m = 4, 16
    topk_ids = torch.tensor([[3, 0], [0, -1], [3, 7], [0, 3], [1, 0]])
    num_pairs = topk_ids.numel()
    sorted_pair_ids, expert_ids, num_padded = align_pairs(topk_ids, num_experts, block_m)
    # Runs: expert 0 (4 pairs), 1 (1), 3 (3), out of range (2); expert 2 has none.
    assert num_padded.tolist() == [4 * block_m]
    assert sorted_pair_ids.shape[0] % block_m == 0 and sorted_pair_ids.shape[0] >= 4 * block_m
    assert expert_ids.shape[0] == sorted_pair_ids.shape[0] // block_m
    assert expert_ids[:4].tolist() == [0, 1, 3, num_experts]
    blocks = sorted_pair_ids[: 4 * block_m].view(4, block_m)
    for block, expert in zip(blocks.tolist(), expert_ids.tolist()):
        pairs = [p for p in block if p != num_pairs]
        assert block == pairs + [num_pairs] * (block_m - len(pairs))  # padding at the end
        assert pairs == sorted(pairs)  # stable: tokens ascend within an expert
        flat = topk_ids.reshape(-1)
        for p in pairs:
            assert flat[p] == expert or (expert == num_experts and not 0 <= flat[p] < 4)
    assert sorted(p for p in sorted_pair_ids.tolist() if p != num_pairs) == list(range(num_pairs))


def test_tiles_follow_pairs_per_expert():
    assert choose_tiles(torch.bfloat16, 8, 128).block_m == 16
    assert choose_tiles(torch.bfloat16, 8 * 1024, 128).block_m == 64
    assert choose_tiles(torch.float32, 40, 1).block_m == 64


def test_rejects_bad_arguments():
    hidden, w13, w2, topk_weights, topk_ids = random_moe(3, 2, 2, 48, 32, torch.float32)
    bad = {
        "hidden 3-D": (hidden[None], w13, w2, topk_weights, topk_ids),
        "w13 rows": (hidden, w13[:, 1:], w2, topk_weights, topk_ids),
        "w2 hidden": (hidden, w13, w2[:, 1:], topk_weights, topk_ids),
        "dtype mix": (hidden.half(), w13, w2, topk_weights, topk_ids),
        "int hidden": (hidden.int(), w13.int(), w2.int(), topk_weights, topk_ids),
        "ids shape": (hidden, w13, w2, topk_weights, topk_ids[:2]),
        "weights shape": (hidden, w13, w2, topk_weights[:, :1], topk_ids),
        "float ids": (hidden, w13, w2, topk_weights, topk_ids.float()),
        "int weights": (hidden, w13, w2, topk_ids, topk_ids),
        "strided hidden": (torch.randn(48, 3).t(), w13, w2, topk_weights, topk_ids),
        "device mix": (hidden, w13.to("meta"), w2, topk_weights, topk_ids),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError):
            fused_experts_triton(*args)
            pytest.fail(f"accepted {name}")
