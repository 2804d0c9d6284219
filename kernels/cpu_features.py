"""What this CPU and this torch build can do, asked once per process.

Every path that picks a CPU kernel by capability reads `cpu_features()` instead of assuming
the developer's processor: the machines pagemesh is built, tested and served on are not one
generation (AVX2-only AMD Zen 3, AVX-512 + AVX512_BF16 Zen 4 and Xeons, AMX Sapphire Rapids,
ARM). Two kinds of facts, kept apart:

- **The CPU's ISA flags** (`/proc/cpuinfo`): which instruction sets exist. They decide what is
  *fast*: bf16 is a fast compute dtype only where the CPU multiplies bf16 natively
  (AVX512_BF16 or AMX on x86, the BF16 extension on ARM). Elsewhere oneDNN and torch emulate
  it: torch's bf16 matmul ran far slower than fp32 on an AVX2 Zen 3
  (`python -m bench.peers.peak` measures both, decode shape).
- **What the torch build runs** (probed): oneDNN's packed linear kernels raise on a CPU that
  lacks what they need (`mkldnn_reorder_linear_weight: bf16 path needs the cpu support
  avx_ne_convert or avx512bw, avx512vl and avx512dq`). Each is tried once on a tiny input,
  inside a try, and compared with `F.linear`; a kernel that raises or disagrees is not used.

`cpu_features()` logs what it found once; `describe()` is the dict every benchmark result
records beside its figures, so figures from different machines are never read as one.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

logger = logging.getLogger(__name__)

# The ISA flags that change a kernel choice or a figure, in /proc/cpuinfo's spelling
# (x86 "flags", ARM "Features"). Only these are kept and reported.
RELEVANT_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
    "bf16",
    "i8mm",  # aarch64
)
# Native bf16 multiply: AVX512_BF16 (vdpbf16ps), AMX-BF16 tiles, or ARMv8.6 BF16 (bfmmla).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@dataclass(frozen=True)
class CpuFeatures:
    """One machine's CPU and torch build, as far as kernel choices go."""

    model: str  # the CPU's model name ("AMD EPYC 7B13", ...), "unknown" when not readable
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: tuple[str, ...]  # the RELEVANT_FLAGS this CPU has, in RELEVANT_FLAGS' order
    torch_version: str
    torch_cpu_capability: str  # the ATen kernels torch dispatches to: DEFAULT, AVX2, AVX512, ...
    onednn_fp32_linear: bool  # oneDNN packed fp32 linear ran and matched F.linear here
    onednn_bf16_linear: bool  # the same in bf16 (emulated where the CPU lacks native bf16)

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU multiplies bf16 in hardware: bf16 is then faster than fp32."""
        return any(self.has(flag) for flag in NATIVE_BF16_FLAGS)

    def why_bf16_is_slow(self) -> str | None:
        """None where bf16 is native; else the reason, for skips and warnings."""
        if self.native_bf16:
            return None
        return (
            f"bf16 is emulated on this CPU [{self.isa_summary}]: without avx512_bf16 or "
            "amx_bf16 a bf16 matmul runs far slower than fp32 (`python -m bench.peers.peak`)"
        )

    @property
    def isa_summary(self) -> str:
        """The flags a reader compares figures by: "avx2 -avx512f -avx512_bf16 -amx" style."""
        if self.arch in ("aarch64", "arm64"):
            shown = [("asimd", "asimd"), ("sve", "sve"), ("bf16", "bf16")]
        else:
            shown = [
                ("avx2", "avx2"),
                ("avx512f", "avx512f"),
                ("avx512_bf16", "avx512_bf16"),
                ("amx_bf16", "amx"),
            ]
        return " ".join(name if self.has(flag) else f"-{name}" for flag, name in shown)

    def describe(self) -> dict:
        """What a benchmark result file records next to its figures."""
        data = asdict(self)
        data["flags"] = list(self.flags)
        data["native_bf16"] = self.native_bf16
        data["isa"] = self.isa_summary
        return data

    def one_line(self) -> str:
        """ "AMD EPYC (family 25, model 1), x86_64 [avx2 -avx512f -avx512_bf16 -amx],
        torch 2.13.0+cpu"."""
        return machine_line(self.describe())


def machine_line(machine: dict) -> str:
    """One line for a `describe()` dict, also one read back from a result file."""
    return (
        f"{machine['model']}, {machine['arch']} [{machine['isa']}], "
        f"torch {machine['torch_version']}"
    )


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """(model name, relevant flags) from the text of /proc/cpuinfo (x86 or ARM). Under a
    hypervisor the name can be as bare as "AMD EPYC", so x86's family and model numbers
    follow it: they tell Zen 3 (family 25, model 1) from Zen 4 (25, 17)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block says it all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = next(
        (fields[k] for k in ("model name", "cpu model", "hardware") if fields.get(k)), "unknown"
    )
    if "cpu family" in fields and fields.get("model", "").isdigit():
        model = f"{model} (family {fields['cpu family']}, model {fields['model']})"
    present = set((fields.get("flags") or fields.get("features") or "").split())
    return model, tuple(flag for flag in RELEVANT_FLAGS if flag in present)


@functools.cache
def cpu_identity() -> str:
    """The first processor's model and its whole flag list: what native code was built for
    (a cache key; two CPUs with the same string run the same -march=native code)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + " " + platform.processor()
    keep = ("model name", "cpu family", "model", "flags", "features", "cpu part")
    block = text.split("\n\n", 1)[0]
    return "\n".join(
        line for line in block.splitlines() if line.partition(":")[0].strip().lower() in keep
    )


def _onednn_linear_works(dtype: torch.dtype) -> bool:
    """Pack a small weight for oneDNN and multiply by it, as `worker_svc/model/matmul.py`
    does; True only when neither step raises and the result matches F.linear."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False  # torch's own check, before an op that raises
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen).to(dtype)
    w = torch.randn(16, 32, generator=gen).to(dtype)
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as error:
        logger.info("oneDNN %s linear unavailable here: %s", dtype, str(error)[:200])
        return False
    expected = F.linear(x.float(), w.float())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(out.float(), expected, rtol=tolerance, atol=tolerance))


def probe(cpuinfo: str | None = None) -> CpuFeatures:
    """Read the CPU and probe the torch build now (`cpu_features()` caches this)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = parse_cpuinfo(cpuinfo)
    if model == "unknown":
        model = platform.processor() or model
    return CpuFeatures(
        model=model,
        arch=platform.machine(),
        flags=flags,
        torch_version=torch.__version__,
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        onednn_fp32_linear=_onednn_linear_works(torch.float32),
        onednn_bf16_linear=_onednn_linear_works(torch.bfloat16),
    )


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's CPU features, probed on first use and logged once."""
    features = probe()
    logger.info(
        "CPU: %s; torch kernels %s; oneDNN linear fp32 %s, bf16 %s; native bf16 %s",
        features.one_line(),
        features.torch_cpu_capability,
        features.onednn_fp32_linear,
        features.onednn_bf16_linear,
        features.native_bf16,
    )
    return features


def describe() -> dict:
    """`cpu_features().describe()`: the machine line of every benchmark result."""
    return cpu_features().describe()
