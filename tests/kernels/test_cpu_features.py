"""kernels/cpu_features.py: what the CPU has and what the torch build runs, on any CPU.

The parsing is checked on /proc/cpuinfo excerpts of four CPU generations (trimmed to the
lines it reads); the probe runs for real on this machine, whatever it is, and must agree
with torch's own answers and never raise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu_features import CpuFeatures, cpu_features, machine_line, parse_cpuinfo, probe

ZEN3_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes vpclmulqdq

processor\t: 1
flags\t\t: fpu avx512f
"""
ZEN4_AVX512_BF16 = """processor\t: 0
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse4_2 avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni
"""
SAPPHIRE_RAPIDS_AMX = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_fp16 amx_bf16
amx_tile amx_int8 avx_vnni
"""
GRAVITON3_ARM = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve i8mm bf16
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def features(cpuinfo: str, arch: str = "x86_64", **torch_side: object) -> CpuFeatures:
    model, flags = parse_cpuinfo(cpuinfo)
    fields = {
        "torch_version": "2.13.0",
        "torch_cpu_capability": "AVX2",
        "onednn_fp32_linear": True,
        "onednn_bf16_linear": False,
        **torch_side,
    }
    return CpuFeatures(model=model, arch=arch, flags=flags, **fields)


def test_zen3_has_avx2_and_no_native_bf16():
    zen3 = features(ZEN3_AVX2)
    # Only the first processor's block counts (the second one's avx512f is not this CPU's).
    assert zen3.flags == ("sse4_2", "avx", "avx2", "fma", "f16c")
    assert zen3.model == "AMD EPYC (family 25, model 1)"
    assert not zen3.native_bf16
    assert zen3.isa_summary == "avx2 -avx512f -avx512_bf16 -amx"


def test_zen4_and_sapphire_rapids_have_native_bf16():
    zen4 = features(ZEN4_AVX512_BF16, onednn_bf16_linear=True)
    spr = features(SAPPHIRE_RAPIDS_AMX, onednn_bf16_linear=True)
    assert zen4.native_bf16 and spr.native_bf16
    assert zen4.isa_summary == "avx2 avx512f avx512_bf16 -amx"
    assert spr.isa_summary == "avx2 avx512f avx512_bf16 amx"
    assert spr.model.startswith("Intel(R) Xeon(R) Platinum 8481C") and "model 143" in spr.model


def test_arm_features_line():
    arm = features(GRAVITON3_ARM, arch="aarch64")
    assert arm.flags == ("asimd", "sve", "bf16", "i8mm")
    assert arm.native_bf16 and arm.isa_summary == "asimd sve bf16"
    assert arm.model == "unknown"  # ARM kernels name no model; probe() falls back


def test_describe_carries_what_a_figure_needs():
    zen3 = features(ZEN3_AVX2)
    data = zen3.describe()
    assert {
        "model",
        "arch",
        "flags",
        "isa",
        "native_bf16",
        "torch_version",
        "torch_cpu_capability",
        "onednn_bf16_linear",
    } <= set(data)
    assert machine_line(data) == (
        "AMD EPYC (family 25, model 1), x86_64 [avx2 -avx512f -avx512_bf16 -amx], torch 2.13.0"
    )


def test_probe_of_this_machine_agrees_with_torch():
    here = cpu_features()
    assert here == probe()  # the cached answer is the fresh one
    assert here.torch_version == torch.__version__
    assert here.torch_cpu_capability == torch.backends.cpu.get_cpu_capability()
    if torch.backends.mkldnn.is_available():
        assert here.onednn_fp32_linear
    # oneDNN bf16 runs only where torch says its bf16 path is supported.
    if here.onednn_bf16_linear:
        assert torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if here.arch == "x86_64":
        assert here.has("sse4_2")  # every x86-64 CPU torch supports has it
        # torch's own dispatch level never exceeds what the flags say.
        if here.torch_cpu_capability.startswith("AVX512"):
            assert here.has("avx512f")
        if here.torch_cpu_capability.startswith("AVX2"):
            assert here.has("avx2")


def test_features_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu_features().flags = ()  # type: ignore[misc]  (every caller shares one)
