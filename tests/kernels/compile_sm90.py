"""Compile the kernels for an H100/H200 (sm_90a) on a machine without a GPU (a helper, run
by test_sm90_compile.py in a subprocess without TRITON_INTERPRET).

The interpreter never runs Triton's compiler, so a kernel that only fails to compile (a
dtype the tensor cores refuse, a construct the MLIR lowering rejects) would pass every CPU
test. This builds each kernel variant a Llama-style layer launches down to a cubin with the
bundled ptxas and prints its registers and spills, as the launchers would specialise it
(pointers and strides divisible by 16). Exits non-zero if a variant fails or spills.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.fused_moe_triton import _moe_gemm_kernel, choose_tiles
from kernels.kv_store import _store_kv_kernel
from kernels.paged_attention import (
    TILE_TOKENS,
    _decode_partition_kernel,
    _reduce_partitions_kernel,
)
from kernels.prefill_attention import TILES, _prefill_kernel

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
INDEX_POINTERS = (
    "slot_mapping_ptr",
    "block_tables_ptr",
    "seq_lens_ptr",
    "query_start_loc_ptr",
    "seq_ids_ptr",
    "sorted_pair_ids_ptr",
    "expert_ids_ptr",
    "num_padded_ptr",
)
PARTIAL_POINTERS = ("partial_max_ptr", "partial_sum_ptr", "partial_acc_ptr")


def signature(kernel, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    types, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            types[name] = "constexpr"
            continue
        if name == "slot_mapping_ptr":
            types[name] = "*i64"
        elif name in INDEX_POINTERS:
            types[name] = "*i32"
        elif name in PARTIAL_POINTERS:
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = f"*{dtype}"
        else:
            types[name] = "fp32" if name == "scale_log2" else "i32"
        if name.endswith("_ptr") or name.startswith("stride"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return types, attrs


def build(label: str, kernel, dtype: str, constexprs: dict) -> bool:
    types, attrs = signature(kernel, dtype, constexprs)
    source = ASTSource(
        kernel,
        types,
        attrs=attrs,
        constexprs={(kernel.arg_names.index(name),): value for name, value in constexprs.items()},
    )
    try:
        compiled = triton.compile(source, target=TARGET, options={"num_warps": 4})
    except Exception as error:  # noqa: BLE001 - report every variant, then fail
        print(f"{label}: FAILED {type(error).__name__}: {error}")
        return False
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        command = [PTXAS, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull]
        report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    print(f"{label}: {registers} registers, {spilled} bytes spilled")
    return spilled == 0


def variants():
    """(label, kernel, dtype, constexprs): 32 heads / 8 kv heads, blocks of 16 tokens."""
    torch_dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for dtype, head_dim in (("fp16", 128), ("bf16", 96), ("fp32", 64)):
        torch_dtype = torch_dtypes[dtype]
        head_dim_pad = triton.next_power_of_2(head_dim)
        dot_fp32 = dtype == "fp32"
        yield (
            f"store_kv {dtype}",
            _store_kv_kernel,
            dtype,
            dict(
                NUM_KV_HEADS=8,
                HEAD_DIM=head_dim,
                BLOCK_SIZE=16,
                KV_HEADS_PAD=8,
                HEAD_DIM_PAD=head_dim_pad,
            ),
        )
        for split in (False, True):
            label = f"decode {dtype} d{head_dim} split={split}"
            yield (
                label,
                _decode_partition_kernel,
                dtype,
                dict(
                    NUM_HEADS=32,
                    GROUP=4,
                    GROUP_PAD=16,
                    HEAD_DIM=head_dim,
                    HEAD_DIM_PAD=head_dim_pad,
                    BLOCK_SIZE=16,
                    BLOCK_N=TILE_TOKENS[torch_dtype],
                    PARTITION_SIZE=512 if split else 1 << 30,
                    SPLIT=split,
                    DOT_FP32=dot_fp32,
                ),
            )
        yield (
            f"reduce {dtype}",
            _reduce_partitions_kernel,
            dtype,
            dict(
                NUM_HEADS=32,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                PARTITION_SIZE=512,
                PARTITIONS_PAD=64,
            ),
        )
        block_m, block_n = TILES[torch_dtype]
        yield (
            f"prefill {dtype} d{head_dim}",
            _prefill_kernel,
            dtype,
            dict(
                GROUP=4,
                GROUP_PAD=4,
                BLOCK_Q=block_m // 4,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                BLOCK_SIZE=16,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                DOT_FP32=dot_fp32,
            ),
        )
    yield from moe_variants()


def moe_variants():
    """The MoE grouped GEMM in bf16 at Qwen3-30B-A3B's shape (128 experts, top 8, hidden
    2048, intermediate 768; N and K are runtime values, the shape picks the tiles): a decode
    step of 1 token and a 2,048-token prefill, each GEMM of the gate|up -> down pair."""
    for num_tokens in (1, 2048):
        tiles = choose_tiles(torch.bfloat16, num_tokens * 8, 128)
        for label, top_k, weighted in (("gate_up", 8, False), ("down", 1, True)):
            yield (
                f"moe {label} bf16 m{tiles.block_m}",
                _moe_gemm_kernel,
                "bf16",
                dict(
                    TOP_K=top_k,
                    MUL_ROUTED_WEIGHT=weighted,
                    DOT_FP32=False,
                    BLOCK_M=tiles.block_m,
                    BLOCK_N=tiles.block_n,
                    BLOCK_K=tiles.block_k,
                ),
            )


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter does not compile")
    results = [build(*variant) for variant in variants()]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
