"""The Triton FP8 and AWQ dequant-matmuls against their torch references (interpreter), and
the references against the worker's CPU path (worker_svc/quant)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.quant_matmul import (  # noqa: E402
    awq_matmul,
    awq_matmul_reference,
    fp8_matmul,
    fp8_matmul_reference,
)
from worker_svc.quant import AwqWeight, Fp8Weight, quantize_fp8_per_channel  # noqa: E402


def random_awq(k: int, n: int, group_size: int, generator: torch.Generator):
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (k, n // 8), generator=generator, dtype=torch.int64
    ).to(torch.int32)
    qzeros = torch.randint(
        -(2**31), 2**31 - 1, (k // group_size, n // 8), generator=generator, dtype=torch.int64
    ).to(torch.int32)
    scales = (torch.rand(k // group_size, n, generator=generator) * 0.02).half()
    return qweight, qzeros, scales


# (M, N, K): single decode rows, ragged tiles in every dim.
SHAPES = [(1, 64, 64), (5, 96, 160), (37, 128, 96)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_matmul_matches_reference(m, n, k, with_bias):
    generator = torch.Generator().manual_seed(m * n + k)
    weight, scale = quantize_fp8_per_channel(torch.randn(n, k, generator=generator))
    x = torch.randn(m, k, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None
    expected = fp8_matmul_reference(x, weight, scale, bias)
    torch.testing.assert_close(fp8_matmul(x, weight, scale, bias), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        Fp8Weight(weight, scale).apply(x, bias), expected, rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group_size", [32, 16])
def test_awq_matmul_matches_reference(m, n, k, group_size):
    generator = torch.Generator().manual_seed(m * n + k + group_size)
    qweight, qzeros, scales = random_awq(k, n, group_size, generator)
    x = torch.randn(m, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    expected = awq_matmul_reference(x, qweight, qzeros, scales, group_size, bias)
    torch.testing.assert_close(
        awq_matmul(x, qweight, qzeros, scales, group_size, bias), expected, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        AwqWeight(qweight, qzeros, scales, group_size).apply(x, bias),
        expected,
        rtol=1e-6,
        atol=1e-6,
    )


def test_bf16_activations_give_bf16_results():
    generator = torch.Generator().manual_seed(3)
    weight, scale = quantize_fp8_per_channel(torch.randn(64, 64, generator=generator))
    x = torch.randn(4, 64, generator=generator).to(torch.bfloat16)
    out = fp8_matmul(x, weight, scale)
    assert out.dtype == torch.bfloat16
    # The kernel accumulates in fp32 and rounds once: within bf16's half ulp of the fp32 result.
    expected = fp8_matmul_reference(x.float(), weight, scale).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=1e-2)


def test_wrappers_reject_bad_arguments():
    weight, scale = quantize_fp8_per_channel(torch.randn(64, 32))
    with pytest.raises(ValueError, match="x must be"):
        fp8_matmul(torch.randn(2, 48), weight, scale)
    with pytest.raises(ValueError, match="scale must be"):
        fp8_matmul(torch.randn(2, 32), weight, scale[:10])
    qweight, qzeros, scales = random_awq(64, 64, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="group_size"):
        awq_matmul(torch.randn(2, 64), qweight, qzeros, scales, 48)
    with pytest.raises(ValueError, match="qzeros"):
        awq_matmul(torch.randn(2, 64), qweight, qzeros[:1], scales, 32)
