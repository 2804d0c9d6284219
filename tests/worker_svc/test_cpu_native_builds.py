"""The C kernels (kernels/cpu_native.py) build on this machine, are what actually runs, and
compute the reference's results at every x86-64 ISA level this CPU can execute.

`-march=native` code differs per CPU (AVX2 on a Zen 3, AVX-512 on a Zen 4), so a kernel
that is right on the developer's CPU can be wrong on another. Each level is built
explicitly (`-march=x86-64` SSE2 baseline, `-v2`, `-v3` AVX2+FMA, `-v4` AVX-512) and run
where the CPU has its instructions; a level it lacks is skipped, naming what is missing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import cpu_attention, cpu_decode, cpu_gguf, cpu_linear, cpu_native, reference
from kernels import moe as moe_kernels
from kernels.cpu_features import cpu_features
from tests.support.paged_batch import assert_matches_reference, build_paged_batch
from worker_svc.quant.gguf import dequantize_gguf

HAS_COMPILER = cpu_native.compiler() is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler (cc/gcc/$CC) on PATH")

# The x86-64 micro-architecture levels and the ISA flags a CPU needs to run each.
X86_LEVELS = {
    "x86-64": (),
    "x86-64-v2": ("sse4_2",),
    "x86-64-v3": ("avx2", "fma", "f16c"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
}


def _skip_unless_x86() -> None:
    if cpu_features().arch != "x86_64":
        pytest.skip(f"x86-64 ISA levels; this CPU is {cpu_features().arch}")


def _skip_unless_runnable(level: str) -> None:
    missing = [flag for flag in X86_LEVELS[level] if not cpu_features().has(flag)]
    if missing:
        pytest.skip(
            f"{level} built, but its code cannot run here: this CPU lacks {', '.join(missing)}"
        )


@needs_compiler
def test_native_kernels_build_where_a_compiler_exists():
    for name in cpu_native.SOURCES:
        assert cpu_native.library(name) is not None, cpu_native.build_error(name)
    assert cpu_decode.available(torch.float32) and cpu_decode.available(torch.bfloat16)


def test_the_config_comes_from_the_variables_users_set(tmp_path):
    config = cpu_native.native_kernel_config_from_env(
        {
            "CC": "/opt/bin/cc",
            "PAGEMESH_KERNEL_CACHE": str(tmp_path),
            "PAGEMESH_NATIVE_KERNELS": "0",
        }
    )
    assert config == cpu_native.NativeKernelConfig(
        compiler="/opt/bin/cc", cache_dir=tmp_path, enabled=False
    )
    defaults = cpu_native.native_kernel_config_from_env({})
    assert defaults == cpu_native.NativeKernelConfig()
    assert defaults.cache_dir == Path.home() / ".cache" / "pagemesh" / "kernels"
    assert defaults.enabled and defaults.compiler == cpu_native.find_compiler()
    empty = {"CC": "", "PAGEMESH_KERNEL_CACHE": "", "PAGEMESH_NATIVE_KERNELS": "1"}
    assert cpu_native.native_kernel_config_from_env(empty) == defaults


@needs_compiler
def test_the_kernels_follow_the_installed_config_not_the_environment(monkeypatch, native_kernels):
    # Read once by the entry point: a variable changed later does nothing.
    native_kernels(enabled=True)
    monkeypatch.setenv("PAGEMESH_NATIVE_KERNELS", "0")
    assert cpu_native.library("cpu_decode") is not None
    native_kernels(enabled=False)
    assert cpu_native.library("cpu_decode") is None and not cpu_decode.available(torch.float32)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_backend_decodes_through_the_c_kernel(dtype, native_kernels):
    # NaN fills every cache slot no sequence owns: the torch path's gather reads them (NaN
    # out), the C kernel never does. A finite, correct result proves the C kernel ran.
    native_kernels(enabled=True)
    batch = build_paged_batch([1, 16, 17, 50, 33], [1] * 5, 8, 2, 64, 16, dtype, seed=5)
    args = (*batch.args(), 0.125)
    expected = reference.paged_attention(*batch.reference_args(), 0.125)
    assert_matches_reference(cpu_attention.paged_attention(*args), expected)
    native_kernels(enabled=False)
    assert torch.isnan(cpu_attention.paged_attention(*args)).any()  # the test can tell


def _gguf_case(type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import gguf

    rng = np.random.default_rng(1)
    weights = rng.standard_normal((24, 128)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name]))
    x = torch.from_numpy(rng.standard_normal((5, 128)).astype(np.float32))
    return blocks, x, x @ dequantize_gguf(blocks, type_name).T


@needs_compiler
@pytest.mark.parametrize("level", list(X86_LEVELS))
def test_each_isa_level_matches_the_reference(level, tmp_path):
    _skip_unless_x86()
    config = dataclasses.replace(cpu_native.current_config(), cache_dir=tmp_path)
    arch = (f"-march={level}",)
    # Every level compiles on any x86-64 machine (AVX-512 code included); it runs only where
    # the CPU has the instructions.
    decode = cpu_native._build("cpu_decode", arch, config)
    gguf_lib = cpu_native._build("cpu_gguf", arch, config)
    linear_lib = cpu_native._build("cpu_linear", arch, config)
    _skip_unless_runnable(level)
    for dtype in (torch.float32, torch.bfloat16):
        for window in (None, 9):
            batch = build_paged_batch(
                [1, 16, 17, 50, 33, 130], [1] * 6, 8, 2, 64, 16, dtype, seed=3
            )
            out = cpu_decode.paged_decode(
                batch.query,
                batch.k_cache,
                batch.v_cache,
                batch.block_tables,
                batch.seq_lens,
                0.125,
                window,
                lib=decode,
            )
            expected = reference.paged_attention(
                *batch.reference_args(), 0.125, sliding_window=window
            )
            assert_matches_reference(out, expected)
    # One long request over four threads: the KV split's parts and their merge at this level.
    batch = build_paged_batch([700], [1], 9, 3, 64, 16, torch.float32, seed=4)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out = cpu_decode.paged_decode(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            0.125,
            lib=decode,
        )
    finally:
        torch.set_num_threads(before)
    assert_matches_reference(out, reference.paged_attention(*batch.reference_args(), 0.125))
    # A mixed batch in one call: prompt tiles, chunks after context, decodes, at this level's
    # vector width (16 floats on AVX-512, 8 on AVX2, 4 on SSE).
    for dtype in (torch.float32, torch.bfloat16):
        batch = build_paged_batch([1, 70, 150, 40], [1, 70, 67, 1], 9, 3, 64, 16, dtype, seed=5)
        out = cpu_decode.paged_attention(
            batch.query,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            0.125,
            24,
            lib=decode,
        )
        assert_matches_reference(
            out, reference.paged_attention(*batch.reference_args(), 0.125, sliding_window=24)
        )
    for type_name in cpu_gguf.GGUF_TYPES:
        blocks, x, expected = _gguf_case(type_name)
        out = torch.empty(x.shape[0], blocks.shape[0])
        assert cpu_gguf.gguf_matmul(type_name, blocks, x, out, lib=gguf_lib)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    # One vector per panel row: a zmm of 16 floats where the level has AVX-512, else 8.
    assert linear_lib.linear_panel() == (16 if level == "x86-64-v4" else 8)
    # each row tile, 6-row tiles with a remainder, and prefill's row blocks and tiles
    for rows in (1, 2, 5, 13, 70, 245):
        weight, x, bias = torch.randn(75, 96), torch.randn(rows, 96), torch.randn(75)
        packed = cpu_linear.pack_linear_f32(weight, lib=linear_lib)
        out = cpu_linear.linear_f32(x, packed, 75, bias, lib=linear_lib)
        torch.testing.assert_close(
            out, torch.nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4
        )
    # A MoE layer's experts in one call (moe_f32) at this level's panel width, with an expert
    # another rank holds (-1) and an intermediate size off the panel width.
    experts, hidden, inter = 5, 48, 40
    w13 = torch.randn(experts, 2 * inter, hidden) * 0.1
    w2 = torch.randn(experts, hidden, inter) * 0.1
    x = torch.randn(9, hidden)
    weights, ids = moe_kernels.route(torch.randn(9, experts), 2, True, torch.float32)
    ids[0, 1] = -1
    out = cpu_linear.moe_f32(
        x,
        weights,
        ids,
        torch.cat([cpu_linear.pack_linear_f32(w, lib=linear_lib) for w in w13]),
        torch.cat([cpu_linear.pack_linear_f32(w, lib=linear_lib) for w in w2]),
        experts,
        inter,
        lib=linear_lib,
    )
    torch.testing.assert_close(
        out, moe_kernels.fused_experts(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-5
    )


@needs_compiler
def test_a_compiler_that_refuses_march_native_still_builds(tmp_path, caplog):
    # Some compilers (older clang for ARM, say) have no -march=native: the build falls back
    # to -mcpu=native, then to the compiler's baseline, and says so.
    real = cpu_native.compiler()
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -march=native ] && '
        '{ echo "unsupported option -march=native" >&2; exit 1; }; done\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    config = cpu_native.NativeKernelConfig(compiler=str(wrapper), cache_dir=tmp_path / "cache")
    with caplog.at_level("WARNING", logger="kernels.cpu_native"):
        lib = cpu_native._build("cpu_decode", config=config)
    assert "the compiler refused -march=native" in caplog.text
    batch = build_paged_batch([5, 40], [1, 1], 4, 2, 32, 8, torch.float32, seed=2)
    out = cpu_decode.paged_decode(
        batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.2, lib=lib
    )
    assert_matches_reference(out, reference.paged_attention(*batch.reference_args(), 0.2))
