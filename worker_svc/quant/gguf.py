"""GGUF linear layers kept in their quantized blocks (`--gguf-keep-quantized`).

By default the loader dequantizes every GGUF tensor to the model dtype. With the flag, the
decoder's linear layers keep llama.cpp's raw blocks (a uint8 [rows, bytes per row] tensor)
and a `GgufWeight` dequantizes them per matmul: a Q4_1 layer takes 0.625 bytes per weight
instead of 4 (fp32). For a few rows (decoding), Q8_0/Q4_0/Q4_1 layers go to the C kernel
`kernels/cpu_gguf.c` instead, which dequantizes block by block inside the matmul and so
reads each block once; its weights are gguf's exactly, its sums in its own order. Each dequantizer
here repeats `gguf.quants.dequantize`'s fp32
arithmetic op for op, so the values, and the matmul results, equal the dequantize-at-load
path exactly.

Blocks run along rows (input features). Column-parallel layers cut rows: any shard works.
Row-parallel layers cut input features, so a layer stays quantized only when its shard
starts and ends on whole blocks; otherwise, or when a type has no dequantizer here, the
layer is dequantized at load (and a log line says which and why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from kernels import cpu_gguf
from worker_svc.model.layers import MergedLinear
from worker_svc.model.llama import LlamaForCausalLM, checkpoint_leaf
from worker_svc.model.matmul import PreparedWeight
from worker_svc.model.moe import FusedExperts
from worker_svc.model.parallel_layers import Index, RowParallelLinear

logger = logging.getLogger(__name__)

QK_K = 256  # weights per K-quant super-block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as fp32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [n, k * group] -> [n, k, 2 * group]: per group, low nibbles then high ones."""
    qs = qs.reshape(qs.shape[0], -1, 1, group) >> _shifts((0, 4), qs.device)
    return (qs & 0x0F).reshape(qs.shape[0], -1, 2 * group)


def _shifts(bits: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8, device=device).reshape(1, 1, -1, 1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], -1)
    return _f16(b, 0) * (q.to(torch.int8) - 8).to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], -1).to(torch.float32)
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes per block (a little-endian uint32) -> its 32 bits as uint8 [n, 32]."""
    qh = qh.to(torch.int64)
    word = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
    bits = torch.arange(32, device=qh.device)
    return ((word[:, None] >> bits) & 1).to(torch.uint8)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:], 16).reshape(b.shape[0], -1) | (_q5_high_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16).to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:], 16).reshape(b.shape[0], -1) | (_q5_high_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.to(torch.float32) + _f16(b, 2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 4:16].reshape(n, 3, 4)
    d6, m6, md = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = torch.cat([d6 & 0x3F, (md & 0x0F) | ((d6 >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m6 & 0x3F, (md >> 4) | ((m6 >> 2) & 0x30)], dim=-1)
    d = (_f16(b, 0) * sc.to(torch.float32)).reshape(n, -1, 1)
    dm = (_f16(b, 2) * mn.to(torch.float32)).reshape(n, -1, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, -1, 32).to(torch.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16(b, 208) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = (qh.reshape(n, -1, 1, 32) >> _shifts((0, 2, 4, 6), b.device)) & 0x03
    q = (low | (high.reshape(n, -1, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, QK_K // 16, -1).to(torch.float32)).reshape(n, QK_K)


# GGML type name -> (weights per block, bytes per block, blocks [n, bytes] -> fp32 [n, weights])
_DEQUANTIZERS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q6_K": (QK_K, 210, _q6_k),
}
GGUF_KEEP_TYPES = tuple(_DEQUANTIZERS)


def gguf_block_size(type_name: str) -> tuple[int, int]:
    """(weights, bytes) per block of a type this module keeps quantized."""
    block_size, type_size, _ = _DEQUANTIZERS[type_name]
    return block_size, type_size


def dequantize_gguf(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """uint8 [rows, bytes per row] of `type_name` blocks -> fp32 [rows, in features],
    equal to `gguf.quants.dequantize` bit for bit."""
    block_size, type_size, fn = _DEQUANTIZERS[type_name]
    rows, num_bytes = blocks.shape
    if blocks.dtype != torch.uint8 or num_bytes % type_size:
        raise ValueError(
            f"{type_name} blocks must be uint8 [rows, k * {type_size}], got "
            f"{blocks.dtype} {tuple(blocks.shape)}"
        )
    out = fn(blocks.reshape(-1, type_size))
    return out.reshape(rows, num_bytes // type_size * block_size)


class GgufWeight(PreparedWeight):
    """A linear layer's weight as GGUF blocks: `parts` are
    (type name, uint8 [rows, bytes per row]) stacked along the output dim (q|k|v parts of
    one type are merged into one)."""

    def __init__(self, parts: list[tuple[str, torch.Tensor]], in_features: int) -> None:
        merged: list[tuple[str, torch.Tensor]] = []
        for type_name, blocks in parts:
            block_size, type_size = gguf_block_size(type_name)
            if (
                blocks.dtype != torch.uint8
                or blocks.shape[1] != in_features // block_size * type_size
            ):
                raise ValueError(
                    f"{type_name} blocks for {in_features} input features must be "
                    f"uint8 [rows, {in_features // block_size * type_size}], got "
                    f"{blocks.dtype} {tuple(blocks.shape)}"
                )
            if merged and merged[-1][0] == type_name:
                merged[-1] = (type_name, torch.cat([merged[-1][1], blocks]))
            else:
                merged.append((type_name, blocks.contiguous()))
        self.parts = merged
        self.in_features = in_features

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(blocks.numel() for _, blocks in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in `dtype` (cast from fp32, as loading a dequantized GGUF casts)."""
        weights = [dequantize_gguf(blocks, name).to(dtype) for name, blocks in self.parts]
        return weights[0] if len(weights) == 1 else torch.cat(weights)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        fused = self._fused_matmul(x)
        if fused is not None:
            return fused if bias is None else fused + bias
        # One layer's dequantized copy lives only for this call.
        return F.linear(x, self.dequantize(x.dtype), bias)

    def _fused_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """A few rows of x (decoding) on CPU: `kernels/cpu_gguf.c` reads each block once and
        never writes the dequantized layer out; None where it does not apply (then the
        layer is dequantized: many rows are compute-bound and go to BLAS)."""
        if (
            x.device.type != "cpu"
            or x.dim() != 2
            or x.shape[0] > cpu_gguf.GGUF_MAX_ROWS
            or any(name not in cpu_gguf.GGUF_TYPES for name, _ in self.parts)
        ):
            return None
        x32 = x.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], sum(b.shape[0] for _, b in self.parts))
        start = 0
        for name, blocks in self.parts:
            if not cpu_gguf.gguf_matmul(name, blocks, x32, out[:, start : start + blocks.shape[0]]):
                return None
            start += blocks.shape[0]
        return out.to(x.dtype)


class GgufKeptLoad:
    """Which linear layers keep their GGUF blocks, and filling them; built on the meta-device
    model before it is materialised (see `free_weights`).

    `tensor_types` maps every checkpoint (Hugging Face) tensor name to its GGML type name.
    """

    def __init__(self, model: LlamaForCausalLM, tensor_types: dict[str, str]) -> None:
        self.model = model
        # module path -> (module, {part: (checkpoint weight name, rows)})
        self.layers: dict[
            str, tuple[MergedLinear | RowParallelLinear, dict[str | None, tuple[str, int]]]
        ] = {}
        self.kept_names: dict[str, tuple[str, str | None]] = {}  # weight name -> (path, part)
        # MoE layers kept whole: experts path -> (module, {weight name: (expert, part)}).
        self.expert_layers: dict[str, tuple[FusedExperts, dict[str, tuple[int, str]]]] = {}
        skipped: dict[str, list[str]] = {}
        for path, module in model.named_modules():
            if isinstance(module, FusedExperts):
                self._keep_experts(path, module, tensor_types, skipped)
                continue
            if isinstance(module, MergedLinear):
                parent = path.rpartition(".")[0]
                names = {
                    p: (f"{parent}.{checkpoint_leaf(path, p)}.weight", rows)
                    for p, rows in module.part_sizes.items()
                }
                in_start = 0
            elif isinstance(module, RowParallelLinear):
                names = {None: (f"{path}.weight", module.weight.shape[0])}
                in_start = module.in_start
            else:
                continue
            types = {tensor_types.get(name, "?") for name, _ in names.values()}
            reason = _why_not_kept(types, in_start, module.weight.shape[1])
            if reason is not None:
                skipped.setdefault(reason, []).append(path)
                continue
            self.layers[path] = (module, names)
            self.kept_names |= {name: (path, part) for part, (name, _) in names.items()}
        for reason, paths in skipped.items():
            logger.info(
                "GGUF: %d linear layers dequantized at load (%s), e.g. %s",
                len(paths),
                reason,
                paths[0],
            )
        self.type_names = sorted({tensor_types[name] for name in self.kept_names})

    def _keep_experts(
        self,
        path: str,
        module: FusedExperts,
        tensor_types: dict[str, str],
        skipped: dict[str, list[str]],
    ) -> None:
        """Keep a MoE layer's experts as blocks when all of them can be (each expert's gate|up
        then multiplies as one GgufWeight, its down as another)."""
        names = {
            f"{path}.{e}.{part}.weight": (e, part)
            for e in module.global_ids
            for part in ("gate_proj", "up_proj", "down_proj")
        }
        hidden = module.w13.shape[2]
        for inputs, in_start, parts in (
            (hidden, 0, ("gate_proj", "up_proj")),
            (module.intermediate_size, module.intermediate_start, ("down_proj",)),
        ):
            types = {tensor_types.get(n, "?") for n, (_, p) in names.items() if p in parts}
            reason = _why_not_kept(types, in_start, inputs)
            if reason is not None:
                skipped.setdefault(reason, []).append(path)
                return
        self.expert_layers[path] = (module, names)
        self.kept_names |= {name: (path, None) for name in names}

    @property
    def quantization(self) -> str:
        """e.g. "gguf-q4_1" ("gguf-q4_k+q6_k" for several types); "none" if none kept."""
        if not self.type_names:
            return "none"
        return "gguf-" + "+".join(name.lower() for name in self.type_names)

    def free_weights(self) -> None:
        """Replace each kept layer's plain weight by an empty one (only `in` survives)."""
        for module, _ in self.layers.values():
            weight = module.weight
            module.weight = nn.Parameter(
                torch.empty((0, weight.shape[1]), dtype=weight.dtype, device=weight.device),
                requires_grad=False,
            )
        for experts, _ in self.expert_layers.values():
            w13, w2 = experts.w13, experts.w2
            experts.w13 = nn.Parameter(
                w13.new_empty((w13.shape[0], 0, w13.shape[2])), requires_grad=False
            )
            experts.w2 = nn.Parameter(
                w2.new_empty((w2.shape[0], w2.shape[1], 0)), requires_grad=False
            )

    def select(self, name: str) -> Index | None:
        """`checkpoint_slice` for the dequantizing stream: kept weights are not read there."""
        return None if name in self.kept_names else self.model.checkpoint_slice(name)

    def select_blocks(self, name: str, type_name: str) -> Index | None:
        """The slice of a kept weight's raw blocks [rows, bytes per row] this rank holds:
        the plain weight's rows, or its input features translated to bytes."""
        if name not in self.kept_names:
            return None
        base = self.model.checkpoint_slice(name)
        if base is None or len(base) < 2:
            return base
        block_size, type_size = gguf_block_size(type_name)
        cut = base[1]
        # Whole blocks: checked in __init__ (`_why_not_kept`).
        return (
            base[0],
            slice(cut.start // block_size * type_size, cut.stop // block_size * type_size),
        )

    def fill(self, blocks: Iterator[tuple[str, str, torch.Tensor]]) -> None:
        """Consume (weight name, type name, this rank's blocks) and set every kept layer's
        `packed_weight`; raises naming what is missing."""
        parts: dict[str, dict[str | None, tuple[str, torch.Tensor]]] = {}
        expert_blocks: dict[str, tuple[str, torch.Tensor]] = {}
        for name, type_name, tensor in blocks:
            path, part = self.kept_names[name]
            if path in self.expert_layers:
                expert_blocks[name] = (type_name, tensor)
            else:
                parts.setdefault(path, {})[part] = (type_name, tensor)
        missing = [
            name
            for name, (path, part) in self.kept_names.items()
            if part not in parts.get(path, {}) and name not in expert_blocks
        ]
        if missing:
            raise ValueError(f"GGUF is missing {len(missing)} tensors, e.g. {missing[:5]}")
        for module, names in self.expert_layers.values():
            _fill_experts(module, names, expert_blocks)
        for path, (module, names) in self.layers.items():
            ordered = [parts[path][part] for part in names]  # part order = output order
            for (_, tensor), (name, rows) in zip(ordered, names.values()):
                if tensor.shape[0] != rows:
                    raise ValueError(f"{name}: expected {rows} rows, got {tensor.shape[0]}")
            module.packed_weight = GgufWeight(ordered, module.weight.shape[1])


def _fill_experts(
    module: FusedExperts,
    names: dict[str, tuple[int, str]],
    blocks: dict[str, tuple[str, torch.Tensor]],
) -> None:
    """Each expert's gate and up blocks as one GgufWeight (gate rows, then up rows: w13's
    order) and its down blocks as another, in local expert order."""
    by_expert: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}
    for name, (expert, part) in names.items():
        by_expert.setdefault(expert, {})[part] = blocks[name]
        module.loaded.add((expert, part))
    hidden, inter = module.w13.shape[2], module.intermediate_size
    module.packed = [
        (
            GgufWeight([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]], hidden),
            GgufWeight([by_expert[e]["down_proj"]], inter),
        )
        for e in module.global_ids
    ]


def _why_not_kept(types: set[str], in_start: int, in_features: int) -> str | None:
    if len(types) == 1 and next(iter(types)) in ("F32", "F16", "BF16"):
        return f"not quantized ({next(iter(types))})"
    unsupported = sorted(types - set(GGUF_KEEP_TYPES))
    if unsupported:
        return f"no per-matmul dequantizer for {'/'.join(unsupported)}"
    for type_name in types:
        block_size, _ = gguf_block_size(type_name)
        if in_start % block_size or in_features % block_size:
            return (
                f"this rank's input features [{in_start}, {in_start + in_features}) "
                f"are not whole {type_name} blocks of {block_size}"
            )
    return None
