"""The ctypes wrapper of `kernels/cpu_gguf.c` (built by `cpu_native.py`): the GGUF
dequant-matmul for decoding (`gguf_matmul`), a few rows of x against a linear layer's
quantized blocks, dequantized with gguf's exact fp32 arithmetic."""

from __future__ import annotations

import ctypes

import torch

from kernels import cpu_native

GGUF_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
GGUF_MAX_ROWS = 16  # cpu_gguf.c's MAX_ROWS: more rows are compute-bound, better dequantized


def gguf_matmul(
    type_name: str,
    blocks: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    lib: ctypes.CDLL | None = None,
) -> bool:
    """out[:, :rows] = x @ W^T for W in GGUF blocks (uint8 [rows, bytes]); x and out fp32,
    contiguous, x with at most GGUF_MAX_ROWS rows. False (nothing written) when the kernel
    cannot do it here: no compiler, another type, too many rows. `lib`: as
    `cpu_decode.paged_decode`'s."""
    lib = lib or cpu_native.library("cpu_gguf")
    if (
        lib is None
        or type_name not in GGUF_TYPES
        or not 0 < x.shape[0] <= GGUF_MAX_ROWS
        or x.dtype != torch.float32
        or out.dtype != torch.float32
    ):
        return False
    code = lib.gguf_matmul(
        GGUF_TYPES[type_name],
        blocks.data_ptr(),
        blocks.shape[0],
        x.shape[1],
        x.data_ptr(),
        x.shape[0],
        out.data_ptr(),
        out.stride(0),
        max(1, torch.get_num_threads()),
    )
    return code == 0
